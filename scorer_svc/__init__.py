"""The scorer: target-model runner, KV cache, batching, and the Scorer servicer."""
