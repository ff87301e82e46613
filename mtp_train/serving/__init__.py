"""Serving in one place: the engine layouts a trained head is exported in (`layouts`), and vLLM, the
engine that judges them in the tests (`vllm_plugin`: the model classes stock vLLM lacks, registered
through the `vllm.general_plugins` entry point; `vllm_engine`: the engine's arguments for a target and
an exported head, and its spec-decode counters read back). Nothing here is imported by training."""
