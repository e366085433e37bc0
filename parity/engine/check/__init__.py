"""`parity CKPT`: a module under test (the repository's, or ``--target``) against transformers' own, one layer
(unit) at a time: the target built and filled, the inputs, the verdict and the diagnosis."""
