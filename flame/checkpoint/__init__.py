"""Checkpoints: which step a run loads (steps), what makes a step complete (manifest), torchtitan's manager with
both (manager), saves that could not be written (save_failures), and the conversions to and from Hugging Face models
(export, where an export may go: destination, import_hf, llama_export, model_card)."""
