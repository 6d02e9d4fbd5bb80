"""lm-eval's own command line (``lm_eval ...``), in a process where flame's model types load.

    python tests/scripts/lm_eval_cli.py --model hf --model_args pretrained=DIR --tasks ... [lm_eval's options]

``flame.register()`` first, as flame's exports say to (their model card): custom_models' and
fla's types then load with transformers' Auto classes; the rest is lm-eval's ``cli_evaluate``.
"""

import sys

import flame

if __name__ == "__main__":
    flame.register()
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    cli_evaluate()
