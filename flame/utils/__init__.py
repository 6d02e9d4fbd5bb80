"""The documented commands of checkpoint conversion and pretokenizing, by the names users type:

    python -m flame.utils.convert_dcp_to_hf ...   (flame.checkpoint.export)
    python -m flame.utils.convert_hf_to_dcp ...   (flame.checkpoint.import_hf)
    python -m flame.utils.preprocess ...          (flame.tools.preprocess)

Entry points only: the code lives in the layers named beside each.
"""
