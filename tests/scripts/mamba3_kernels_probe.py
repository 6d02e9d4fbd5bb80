"""What fla's mamba3 layer gets from the mamba_ssm on sys.path, alone and through flame.

    PYTHONPATH=<mamba_ssm site>:<repository root> python tests/scripts/mamba3_kernels_probe.py MAMBA3_CONFIG

A fresh interpreter (the pytest process has imported fla without mamba_ssm). Prints one JSON
line, which test_mamba3_kernels.py checks:
    fla_alone                   whether fla, imported before flame, found mamba_ssm's SISO kernel
    siso                        the module of the SISO kernel fla's layer calls after flame loaded it
    siso_backward_unpacks_once  whether that kernel's backward runs under activation checkpointing
    fast_path, norms_eager, mimo, mamba2_fast_path   the layer's settings after flame
    mamba_ssm_after             "ok" or the ImportError of importing mamba_ssm itself
    preflight_<variant>         "accepted" or preflight's error, for siso, mimo and mimo_chunk16
"""

import copy
import importlib
import json
import os
import sys
import warnings

warnings.simplefilter("ignore")
os.environ["WORLD_SIZE"] = "1"


def imports(name: str) -> str:
    try:
        importlib.import_module(name)
        return "ok"
    except ImportError as error:
        return str(error)


# fla first, on its own: what it finds without flame's help
import fla.layers.mamba2  # noqa: E402
import fla.layers.mamba3  # noqa: E402

report = {"fla_alone": fla.layers.mamba3.mamba3_siso_combined is not None}
# fla's failed imports leave some mamba_ssm submodules behind, through which later imports of other
# submodules happen to get past the package's __init__; flame must not rely on those leftovers
for name in [name for name in sys.modules if name.startswith("mamba_ssm.")]:
    del sys.modules[name]

# flame only now, after the leftovers are gone
from flame.base import device  # noqa: E402
from flame.prepare import settled  # noqa: E402
from flame.base.errors import ConfigError  # noqa: E402
from flame.models import load_model_config  # noqa: E402
from flame.prepare.model import ModelUnderCheck, check_model_options  # noqa: E402

config = load_model_config(sys.argv[1])  # imports fla through flame: its patches apply
layer = fla.layers.mamba3
siso = layer.mamba3_siso_combined
report.update(
    siso=getattr(siso, "__module__", None),
    siso_backward_unpacks_once=getattr(siso.__globals__["_Mamba3Function"].backward, "unpacks_once", False)
    if siso else None,
    fast_path=layer.is_fast_path_available,
    norms_eager=getattr(layer.RMSNormGated, "runs_eagerly", False),
    mimo=layer.mamba3_mimo_combined,
    mamba2_fast_path=fla.layers.mamba2.is_fast_path_available,
    mamba_ssm_after=imports("mamba_ssm"),
)
job = settled([f"--model.config={sys.argv[1]}", "--model.tokenizer_path=builtin:python-stdlib-bpe",
                                       "--training.dataset=builtin:python-stdlib"])
device.CUDA = True  # preflight's GPU check comes first; the kernels themselves need no GPU to load
for name, options in {"siso": {}, "mimo": {"is_mimo": True}, "mimo_chunk16": {"is_mimo": True, "chunk_size": 16}}.items():
    variant = copy.deepcopy(config)
    for option, value in options.items():
        setattr(variant, option, value)
    try:
        check_model_options(ModelUnderCheck(variant), job)
        report[f"preflight_{name}"] = "accepted"
    except ConfigError as error:
        report[f"preflight_{name}"] = str(error)
print(json.dumps(report))
