"""`parity compare A B`: checkpoint B's layers judged against A's as functions, with what B's storage allows
and the conversion mistakes that explain a difference."""
