"""Where a checkpoint's FFN units are: the layout a mapping file gives, or the one derived from transformers
(and, for GGUF, gguf's name map). Both flows, a check and a compare, start from it (``resolve``)."""
