"""Parameter groups: which parameters decay, and at what multiple of the scheduled lr each one trains.

Every trainable parameter has a kind, from the module that holds it:

  embeddings  an nn.Embedding's weight (input tokens, learned positions; a head tied to them is one of these)
  head        the output projection (the model's output embeddings)
  norms       a normalization layer's parameters (any module whose class name holds "Norm")
  biases      the other modules' biases
  exempt      parameters the model marks ``_no_weight_decay`` (mamba's and fla's A_log, D, dt_bias)
  hidden      everything else: the decoder blocks' matrices, convolutions, gates

By default embeddings, norms, biases and exempt parameters take no weight decay (the literature's and
Megatron's practice: decay there only shrinks scales and frequencies the model needs);
``--optimizer.decay_everything`` decays every parameter with ``--optimizer.weight_decay``.
``--optimizer.param_groups`` then sets, per kind or per name pattern, a multiple of the lr and a weight decay:

  --optimizer.param_groups "embeddings: lr=0.5; head: lr=2, weight_decay=0; re:.*\\.mlp\\..*: lr=1.5"

Entries apply in order (a later one wins for the parameters both select); ``re:`` patterns fullmatch the
parameter's name as the model names it (model.layers.0.mlp.up_proj.weight), wrappers' prefixes left out. The
parameters of one kind and settings form one torch param group, whose lr the LR schedule scales like any
other: a group's lr is always --optimizer.lr x its multiple x the schedule's factor.
"""

import math
import re
from dataclasses import dataclass

from torch import nn

from flame.base.errors import ConfigError

KINDS = ("embeddings", "head", "norms", "biases", "exempt", "hidden")
NO_DECAY = frozenset({"embeddings", "norms", "biases", "exempt"})  # flame's default
SETTINGS = ("lr", "weight_decay")
# what wrappers put into parameter names (activation checkpointing, torch.compile, FSDP1)
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


@dataclass(frozen=True)
class Rule:
    """One entry of --optimizer.param_groups: the parameters it selects and what it sets for them."""

    selector: str  # a kind, or re:<pattern>
    lr: float | None = None  # multiple of the scheduled lr
    weight_decay: float | None = None

    def selects(self, name: str, kind: str) -> bool:
        if self.selector.startswith("re:"):
            return re.fullmatch(self.selector[3:], name) is not None
        return kind == self.selector


def parse_rules(spec: str) -> list[Rule]:
    """--optimizer.param_groups as rules; ConfigError naming the entry that is not one."""
    rules = []
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        selector, colon, settings = entry.partition(":")
        if selector.strip() == "re":  # re:<pattern>: settings: the pattern's own colon came first
            pattern, colon, settings = settings.partition(":")
            selector = f"re:{pattern}"
        selector = selector.strip()
        if not colon or not settings.strip():
            raise ConfigError(f"--optimizer.param_groups entry '{entry}': write <kind or re:pattern>: lr=<multiple>, "
                              "weight_decay=<value> (entries separated by ';')")
        if selector.startswith("re:"):
            try:
                re.compile(selector[3:])
            except re.error as error:
                raise ConfigError(f"--optimizer.param_groups pattern '{selector[3:]}' is not a regular expression "
                                  f"({error})") from None
        elif selector not in KINDS:
            raise ConfigError(f"--optimizer.param_groups selects '{selector}': a kind ({', '.join(KINDS)}) or "
                              "re:<pattern over parameter names>")
        values: dict[str, float] = {}
        for setting in filter(None, (part.strip() for part in settings.split(","))):
            key, equals, value = (part.strip() for part in setting.partition("="))
            if key not in SETTINGS or not equals:
                raise ConfigError(f"--optimizer.param_groups entry '{entry}': '{setting}' is not lr=<multiple> or "
                                  "weight_decay=<value>")
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"--optimizer.param_groups entry '{entry}': {key} takes a number, not '{value}'") from None
            if not math.isfinite(number) or number < 0 or (key == "lr" and number == 0):
                raise ConfigError(f"--optimizer.param_groups entry '{entry}': {key} must be a finite number "
                                  f"{'above' if key == 'lr' else 'at least'} 0, got {value}")
            values[key] = number
        rules.append(Rule(selector, **values))
    return rules


def clean_name(name: str) -> str:
    return _WRAPPERS.sub("", name)


def kinds_of(model: nn.Module) -> dict[str, tuple[nn.Parameter, str]]:
    """Every trainable parameter of ``model``, by its clean name: (the parameter, its kind), in the model's order."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found: dict[int, tuple[str, nn.Parameter, str]] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in found:  # a tied weight keeps its first module's kind
                continue
            if isinstance(module, nn.Embedding):
                kind = "embeddings"
            elif module is head or module_name.rsplit(".", 1)[-1] in ("lm_head", "output"):
                kind = "head"
            elif "norm" in type(module).__name__.lower():
                kind = "norms"
            elif getattr(param, "_no_weight_decay", False):
                kind = "exempt"
            elif param_name == "bias":
                kind = "biases"
            else:
                kind = "hidden"
            found[id(param)] = (clean_name(f"{module_name}.{param_name}" if module_name else param_name), param, kind)
    return {name: (param, kind) for name, param, kind in found.values()}


@dataclass
class Group:
    """Parameters of one kind (or pattern) and settings: one torch param group."""

    label: str
    lr_multiple: float
    weight_decay: float
    params: list

    def torch_group(self, lr: float) -> dict:
        return {"params": self.params, "lr": lr * self.lr_multiple, "weight_decay": self.weight_decay}


def groups_of(model: nn.Module, optimizer_config, only: set[int] | None = None) -> list[Group]:
    """``model``'s trainable parameters (those whose id is in ``only``, when given) in groups, in the model's order."""
    o = optimizer_config
    rules = parse_rules(o.param_groups)
    groups: dict[tuple, Group] = {}
    for name, (param, kind) in kinds_of(model).items():
        if only is not None and id(param) not in only:
            continue
        label, lr = kind, 1.0
        decay = 0.0 if kind in NO_DECAY and not o.decay_everything else o.weight_decay
        for rule in rules:
            if rule.selects(name, kind):
                label = rule.selector if rule.selector.startswith("re:") else label
                lr = lr if rule.lr is None else rule.lr
                decay = decay if rule.weight_decay is None else rule.weight_decay
        key = (label, lr, decay)
        groups.setdefault(key, Group(label, lr, decay, [])).params.append(param)
    # a group at x1 first: the trainer logs the first group's lr as the run's
    return sorted(groups.values(), key=lambda group: group.lr_multiple != 1)


def check_rules_select(model: nn.Module, spec: str) -> None:
    """Refuse a pattern that selects no parameter of ``model`` (meta), and a kind it has none of, at preflight."""
    kinds = kinds_of(model)
    for rule in parse_rules(spec):
        if not any(rule.selects(name, kind) for name, (_, kind) in kinds.items()):
            example = next(iter(kinds), "")
            raise ConfigError(f"--optimizer.param_groups selects '{rule.selector}', which matches no trainable parameter "
                              f"of the model (its names look like {example}; its kinds here: "
                              f"{', '.join(sorted({kind for _, kind in kinds.values()}))})")


def describe(groups: list[Group], lr: float, optimizer_config) -> str:
    """One line for the log: each group's size and settings, and the default it follows."""
    parts = [f"{group.label} {_count(sum(p.numel() for p in group.params))} (lr {lr * group.lr_multiple:.3g}"
             f"{f' = x{group.lr_multiple:g}' if group.lr_multiple != 1 else ''}, weight_decay {group.weight_decay:g})"
             for group in groups]
    policy = ("weight decay on every parameter (--optimizer.decay_everything)" if optimizer_config.decay_everything
              else "no weight decay on embeddings, norms, biases and exempt parameters, flame's default "
                   "(--optimizer.decay_everything decays them)")
    return f"{'; '.join(parts)}; {policy}"


def _count(params: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if params >= size:
            return f"{params / size:.2f}{unit}"
    return str(params)
