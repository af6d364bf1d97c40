"""A tiny Llama GGUF for the tests of the GGUF target conversion and the engine: the product's own writer
(:func:`decode.llamacpp.write_tiny_llama_gguf`, Q8_0 weights as in a real release), re-exported for the tests."""
from decode.llamacpp import CHATML, write_tiny_llama_gguf  # noqa: F401
