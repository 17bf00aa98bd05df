"""Third-party model code: adapters that turn Hugging Face ``transformers`` models into an ``nn.Sequential``.

The package never imports this folder; recipes and users do (``lightning_gpipe.integrations.transformers``).
"""
