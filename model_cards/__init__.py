"""Jinja2 templates of the model cards turboquant_hf writes (installed as `turboquant_hf.model_cards`)."""
