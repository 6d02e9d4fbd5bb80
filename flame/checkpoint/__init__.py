"""Checkpoints: which step a run loads (steps), what makes a step complete (manifest), torchtitan's manager with
both (manager), and the conversions to and from Hugging Face models (export, import_hf, llama_export, model_card)."""
