"""mixprec inside other trainers: ``mixprec.integrations.lightning`` (a Lightning precision
plugin and monitor callback) and ``mixprec.integrations.huggingface`` (``transformers.Trainer``
and ``accelerate``). Each is imported by name and needs its package installed; ``import
mixprec`` imports none of them."""
