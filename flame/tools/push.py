"""Publish a run's HF export to the Hugging Face hub.

    flame push <dump folder or HF export> --repo_id owner/name [--private] [--revision main]
        [--commit_message ...] [--license apache-2.0] [--dry_run]
    python -m flame.tools.push ...            # the same, where the ``flame`` command is not installed

A dump folder means its export, <dump>/hf. Before anything goes out the export is checked whole
(config.json, the weights and every shard its index names, the tokenizer, README.md) and its model
card (flame.checkpoint.model_card) is read: a card that names this machine's paths (an export by
an earlier flame) is refused, and ``--license`` sets the license of the card that is uploaded
(the export's README.md stays as it is). ``--dry_run`` prints the repo, its visibility, each file
with its size, the total and the card's metadata, and makes no network call: it needs no token.

The repo id comes from ``--repo_id``, else the environment variable FLAME_HUB_REPO; the token from
HF_TOKEN, else huggingface_hub's stored login (``hf auth login``). The upload creates the repo if
needed (``--private``: a new repo is private; an existing one keeps its visibility) and the branch
``--revision`` names, then writes every file in one commit.
"""

import json
import os
import sys
from dataclasses import dataclass

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from flame.base.cli import ArgumentParser
from flame.base.dump_folder import RUN_CONFIG_FILE
from flame.base.errors import ConfigError, gist

REPO_ENV = "FLAME_HUB_REPO"
CARD = "README.md"
EXPORT_COMMAND = "python -m flame.checkpoint.export --path {}"
LOGIN = "log in with `hf auth login` or set HF_TOKEN"
# any of these marks a folder as an export (whole or not: missing_files says what it lacks)
EXPORT_FILES = ("config.json", "adapter_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer_config.json", CARD)


@dataclass(frozen=True)
class Upload:
    """What a push sends: the export's files (path in the repo, bytes; README.md is ``card``) to a repo."""

    folder: str
    repo_id: str
    private: bool
    revision: str
    files: list[tuple[str, int]]
    card: ModelCard

    @property
    def url(self) -> str:
        return f"{constants.ENDPOINT}/{self.repo_id}"


def export_folder(path: str) -> str:
    """The HF export ``path`` names: itself, or a dump folder's hf/; ConfigError if neither holds one."""
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is no folder; give a run's dump folder or its HF export (<dump folder>/hf)")
    if any(os.path.isfile(os.path.join(path, name)) for name in EXPORT_FILES):
        return path
    if os.path.isdir(os.path.join(path, "hf")):
        return os.path.join(path, "hf")
    if os.path.isfile(os.path.join(path, RUN_CONFIG_FILE)):
        raise ConfigError(f"{path} holds no HF export (hf/); make it first: {EXPORT_COMMAND.format(path)}")
    raise ConfigError(f"{path} is neither a dump folder nor an HF export (no config.json, no hf/); give one of those")


def _dump_folder(folder: str) -> str | None:
    """The run's dump folder an export sits in (the export's default place, <dump>/hf), if it does."""
    parent = os.path.dirname(os.path.abspath(folder))
    return parent if os.path.isfile(os.path.join(parent, RUN_CONFIG_FILE)) else None


def missing_files(folder: str) -> list[str]:
    """What an export needs to load from the hub and ``folder`` lacks."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(folder, name))

    if has("adapter_config.json"):  # a LoRA adapter (PEFT's format)
        missing = [] if has("adapter_model.safetensors") else ["adapter_model.safetensors"]
    else:
        missing = [] if has("config.json") else ["config.json"]
        if has("model.safetensors.index.json"):
            try:
                with open(os.path.join(folder, "model.safetensors.index.json")) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError):  # cut short or not an index
                shards = ["a readable model.safetensors.index.json"]
            missing += [name for name in shards if not has(name)]
        elif not has("model.safetensors"):
            missing.append("model.safetensors")
    if not has("tokenizer_config.json"):
        missing.append("tokenizer_config.json")
    if not any(has(name) for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        missing.append("tokenizer.json")
    return missing + ([] if has(CARD) else [CARD])


def _card(folder: str, license: str | None, export_again: str) -> ModelCard:
    path = os.path.join(folder, CARD)
    try:
        card = ModelCard.load(path)  # a local file: read, not downloaded
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: its metadata does not parse ({gist(error)}); fix it or export again: {export_again}")
    places = [os.path.abspath(folder), _dump_folder(folder), os.path.expanduser("~")]
    named = [place for place in places if place and len(place) > 1 and place in card.content]
    if named:
        raise ConfigError(f"{path} names this machine's path {named[0]}; export again to write a card that names "
                          f"none: {export_again}")
    if license:
        card.data.license = license
    return card


def plan(path: str, repo_id: str, private: bool = False, revision: str = "main", license: str | None = None) -> Upload:
    """Everything a push does short of the network: the export checked whole, its card read, its files listed."""
    folder = export_folder(path)
    export_again = EXPORT_COMMAND.format(_dump_folder(folder) or "<dump folder>")
    if missing := missing_files(folder):
        raise ConfigError(f"{folder} is not a complete HF export: it lacks {', '.join(missing)}; export the run again: "
                          f"{export_again}")
    card = _card(folder, license, export_again)
    files = []
    for root, folders, names in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith("."))  # caches, staging: not the model
        for name in sorted(name for name in names if not name.startswith(".")):
            relative = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            files.append((relative, len(str(card).encode()) if relative == CARD else os.path.getsize(os.path.join(root, name))))
    return Upload(folder, repo_id, private, revision, files, card)


def repo_id_of(given: str | None) -> str:
    """The repo to push to: ``--repo_id``, else $FLAME_HUB_REPO, checked as an owner/name hub id."""
    source = "--repo_id" if given else REPO_ENV
    repo_id = given or os.environ.get(REPO_ENV, "")
    if not repo_id:
        raise ConfigError(f"no repo to push to: pass --repo_id owner/name or set {REPO_ENV}")
    if repo_id.count("/") != 1:
        raise ConfigError(f"{source} {repo_id} is not owner/name; give the repo with its owner, e.g. you/my-model")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ConfigError(f"{source} {repo_id} is not a hub repo id ({gist(error)}); give owner/name, e.g. you/my-model")
    return repo_id


def _size(count: int) -> str:
    units, value = ("B", "kB", "MB", "GB", "TB"), float(count)
    while value >= 1000 and units[1:]:
        value, units = value / 1000, units[1:]
    return f"{count} B" if units[0] == "B" else f"{value:.1f} {units[0]}"


def describe(upload: Upload) -> str:
    """The dry run's report: the repo, its visibility, each file with its size, the total, the card's metadata."""
    visibility = "private" if upload.private else "public"
    width = max(len(name) for name, _ in upload.files)
    lines = [f"would push {upload.folder} to {upload.repo_id} ({upload.url}), revision {upload.revision}",
             f"visibility: {visibility} if the push creates the repo (an existing repo keeps its own)"]
    lines += [f"  {name:<{width}}  {_size(size):>9}" for name, size in upload.files]
    lines.append(f"  {len(upload.files)} files, {_size(sum(size for _, size in upload.files))}")
    lines += ["card metadata:"] + [f"  {line}" for line in upload.card.data.to_yaml().splitlines()]
    lines.append("token: found" if get_token() else f"token: none; {LOGIN} before pushing")
    return "\n".join(lines)


def hub_problem(error: Exception, upload: Upload) -> str:
    """A hub error in one line, with its fix."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status == 401:
        return "the hub refused the token (401 Unauthorized): log in with `hf auth login` or set HF_TOKEN to a write token"
    if status == 403:
        return (f"the token may not write to {upload.repo_id} (403 Forbidden): use one with write access to "
                f"{upload.repo_id.split('/')[0]} (`hf auth login` or HF_TOKEN)")
    if status == 404:
        return (f"the hub has no {upload.repo_id} at revision {upload.revision} that this token can reach (404): "
                "check --repo_id and the token (`hf auth login` or HF_TOKEN)")
    if status:
        return f"the hub answered {status} ({gist(error)}); try again later"
    return f"cannot reach the hub at {constants.ENDPOINT} ({gist(error)}): check the network, HF_ENDPOINT and HF_HUB_OFFLINE"


def _from_the_network(error: Exception) -> bool:
    """Whether ``error`` is the hub's answer or the connection's failure: huggingface_hub's HTTP errors, and its HTTP
    client's (httpx in huggingface_hub 1, httpx2 in 2: named by module, so that neither is a dependency of flame)."""
    return isinstance(error, (HfHubHTTPError, OSError)) or type(error).__module__.split(".")[0] in ("httpx", "httpx2")


def push(upload: Upload, commit_message: str) -> str:
    """Create the repo (and branch) if needed and commit every file of ``upload``; the commit's URL."""
    if not get_token():
        raise ConfigError(f"no Hugging Face token: {LOGIN}")
    api = HfApi()
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(upload.card).encode() if name == CARD
                                     else os.path.join(upload.folder, name)) for name, _ in upload.files]
    try:
        api.create_repo(upload.repo_id, private=upload.private, exist_ok=True)
        if upload.revision != "main":
            api.create_branch(upload.repo_id, branch=upload.revision, exist_ok=True)
        commit = api.create_commit(upload.repo_id, operations=operations, commit_message=commit_message,
                                   revision=upload.revision)
    except Exception as error:
        if not _from_the_network(error):
            raise
        raise ConfigError(hub_problem(error, upload)) from None
    return commit.commit_url


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="flame push", description=__doc__.split("\n")[0],
                            epilog=f"The repo id may come from ${REPO_ENV}; the token comes from HF_TOKEN or `hf auth login`.")
    parser.add_argument("folder", path=True, help="a run's dump folder (its hf/ export is pushed) or an HF export folder")
    parser.add_argument("--repo_id", help=f"the hub repo, owner/name (default: ${REPO_ENV})")
    parser.add_argument("--private", action="store_true", help="create the repo private (an existing one keeps its visibility)")
    parser.add_argument("--revision", default="main", help="the branch to commit to, created if missing (default: main)")
    parser.add_argument("--commit_message", help="the commit's message (default: Upload <run> with flame push)")
    parser.add_argument("--license", help="the uploaded card's license, a hub license id such as apache-2.0 "
                                          "(default: the base model's, when its card names one)")
    parser.add_argument("--dry_run", action="store_true", help="print what would be uploaded; no network, no token")
    args = parser.parse_args(argv)
    try:
        upload = plan(args.folder, repo_id_of(args.repo_id), args.private, args.revision, args.license)
        if args.dry_run:
            print(describe(upload))
            return 0
        name = os.path.basename(_dump_folder(upload.folder) or os.path.abspath(upload.folder))
        url = push(upload, args.commit_message or f"Upload {name} with flame push")
    except ConfigError as error:
        print(f"flame push: error: {error}", file=sys.stderr)
        return 2
    print(f"pushed {len(upload.files)} files ({_size(sum(size for _, size in upload.files))}) to {upload.url}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
