"""Our Triton Python-based vLLM backend, imported by ``model.py`` as the package ``vllm_backend``."""
