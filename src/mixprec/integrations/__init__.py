"""mixprec inside other trainers: a Lightning precision plugin (`mixprec.integrations.lightning`)
and Hugging Face hooks (`mixprec.integrations.huggingface`).

Each integration is imported by name and needs its extra (`lightning`, `hf`: in a clone,
`pip install -e ".[lightning]" "torch==2.13.0"`, the torch pin beside it so that their
requirements cannot replace torch); importing this package imports none of those libraries.
"""

__all__: list[str] = []  # each integration is imported by name, with its extra
