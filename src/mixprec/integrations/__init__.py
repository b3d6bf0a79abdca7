"""mixprec inside other trainers: a Lightning precision plugin (`mixprec.integrations.lightning`)
and Hugging Face hooks (`mixprec.integrations.huggingface`).

Each integration is imported by name and needs its extra (`mixprec[lightning]`, `mixprec[hf]`);
importing this package imports none of those libraries.
"""
