"""specdec: speculative decoding for LLMs, served as gRPC microservices."""

__version__ = "0.1.0"
