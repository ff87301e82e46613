"""Inference implementations of targets and drafts: the code that serves, reused for
precompute and validation. Never imports `mtp_train`."""
