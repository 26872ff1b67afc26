"""The shared model runtime: a Llama-family forward pass over ragged batches
(``llama``), its paged KV pool (``kv_pool``), weight loading (``checkpoint``),
the transformers fallback (``hf_engine``) and the one factory that builds an
engine from an ``EngineConfig`` (``factory``). The scorer and the model-draft
proposers both run on it; it imports neither, and no gRPC.
"""
