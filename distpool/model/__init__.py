"""The model description: `ModelSpec` and its derivation from a Hugging Face `config.json`."""
