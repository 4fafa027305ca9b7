"""The meaning of dispatch and combine, written once: routing (the oracle) and quantization."""
