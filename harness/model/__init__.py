"""The model and its precision plan: a precision-agnostic GPT (gpt.py), its loss (loss.py) and
which recipe each module runs (plan.py)."""
