"""Run configuration: pydantic models, loaded from YAML and overridden by CLI flags.

The models here are the single source of truth; YAML files only set values.
An unknown key or a bad value raises ``ConfigError`` whose message names the
key path (``policy.temperature``) and the reason.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .allocator_options import AllocatorOptions, IndependentOptions, allocator_spec
from .errors import ConfigError
from .strict import StrictModel

__all__ = [
    "Config",
    "DistributedConfig",
    "EnvConfig",
    "PolicyConfig",
    "RolloutConfig",
    "SamplingConfig",
    "VLLMConfig",
    "apply_overrides",
    "flag_overrides",
    "ignored_section",
    "load_config",
    "moved_keys",
]


_Strict = StrictModel  # the base of every config section here and in agentrl.train.config


def moved_keys(data: Any, moves: dict[str, str], section: str) -> Any:
    """``data`` (a mapping about to be validated as ``section``) with each old key of ``moves``
    moved to its new place: a new name in the same section (``max_staleness`` to
    ``max_token_staleness``) or a dotted path into a sub-section (``eval_every`` to
    ``evaluation.every``), and a ``FutureWarning`` naming both: an old key keeps working for
    one release. Giving both is an error (which one would win is not obvious)."""
    if not isinstance(data, dict) or not any(old in data for old in moves):
        return data
    data = dict(data)
    for old, new in moves.items():
        if old not in data:
            continue
        *parents, leaf = new.split(".")
        cur = data
        for i, key in enumerate(parents):
            sub = cur.get(key) or {}
            if isinstance(sub, BaseModel):  # a section given as a model (TrainConfig(evaluation=...))
                sub = sub.model_dump(exclude_unset=True)
            if not isinstance(sub, dict):
                raise ValueError(f"{section}.{'.'.join(parents[:i + 1])}: must be a mapping")
            cur[key] = sub = dict(sub)
            cur = sub
        if leaf in cur:
            word = "place" if parents else "name"
            raise ValueError(f"{section}.{old} is the old {word} of {section}.{new}: give only {section}.{new}")
        warnings.warn(f"{section}.{old} is deprecated and will be removed in the next release: "
                      f"use {section}.{new}", FutureWarning, stacklevel=2)
        cur[leaf] = data.pop(old)
    return data


def folded_options(data: Any, section: str, key: str, default: str) -> Any:
    """``data`` (a mapping about to be validated as ``section``) with the old form, ``key: NAME``
    beside ``key_options: {...}``, as the new one, ``key: {name: NAME, <option>: <value>}``, and a
    ``FutureWarning`` naming the new key: the old form keeps working for one release. ``default``
    is the name when only the options are given."""
    old = f"{key}_options"
    if not isinstance(data, dict) or old not in data:
        return data
    data = dict(data)
    options, name = data.pop(old) or {}, data.get(key, default)
    if not isinstance(name, str):
        raise ValueError(f"{section}.{old} is the old place of the options in "
                         f"{section}.{key}: give only {section}.{key}")
    if not isinstance(options, dict):
        raise ValueError(f"{section}.{old}: must be a mapping")
    warnings.warn(f"{section}.{old} is deprecated and will be removed in the next release: "
                  f"use {section}.{key}: {{name: {name}, <option>: <value>}}", FutureWarning, stacklevel=3)
    data[key] = {"name": name, **options}
    return data


_DEVICE = re.compile(r"(cpu|cuda|mps|xpu|hpu|npu|mlu|musa|xla|mtia|ipu|privateuseone)(:\d+)?")


def check_temperature(value: float | None) -> float | None:
    """0 (greedy) or a temperature that samples (``agentrl.policy.base.MIN_TEMPERATURE``: vLLM
    decodes greedily below it and fp32 logits overflow far below it), so a bad one fails
    when the config loads, not in every episode."""
    from .policy.base import MIN_TEMPERATURE

    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"use 0 for greedy decoding, or at least {MIN_TEMPERATURE} to sample")
    return value


def _non_negative_seed(value: int) -> int:
    if value < 0:
        raise ValueError(f"a seed is >= 0 (gymnasium's Env.reset refuses a negative one), got {value}")
    return value


Seed = Annotated[int, AfterValidator(_non_negative_seed)]
"""A task or sampling seed: gymnasium's ``Env.reset`` refuses a negative one, so a config that
named one loaded and then failed each episode on it as an env error."""


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand_path(value: str) -> str:
    """A path from a config as a shell reads it: a leading ``~`` is the home folder, ``$NAME`` and
    ``${NAME}`` the variable's value. YAML keeps both as text: ``out_dir: ~/runs/x`` made a folder
    named '~' in the working directory, ``$SCRATCH/runs`` one named '$SCRATCH'. An unset variable
    is an error: the shell would make it empty, and ``$SCRATCH/runs`` would be /runs; so is a
    value that expands to nothing (``$RUN`` with RUN set to ''), which was the working directory."""
    def value_of(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in os.environ:
            raise ValueError(f"${name} is not set in the environment (the path is {value!r})")
        return os.environ[name]

    expanded = _VARIABLE.sub(value_of, os.path.expanduser(value) if value.startswith("~") else value)
    if value and not expanded:  # Path("") is the working directory, where train --overwrite removes folders
        raise ValueError(f"{value!r} expands to an empty path: its variable is set to ''")
    return expanded


def check_task_seeds(value: list[int] | None) -> list[int] | None:
    """An explicit list of task seeds holds at least one: ``[]`` was read as not given, and
    the default seeds played instead."""
    if value is not None and not value:
        raise ValueError("give at least one seed, or null")
    return value


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 is greedy, else at least 1e-5.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    top_k: int = Field(0, ge=0, description="Keep the k likeliest tokens; 0 disables.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens per turn; the turn is truncated there.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a turn.")

    _temperature = field_validator("temperature")(check_temperature)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("an empty stop string is in every text: every turn would end at once")
        return value


class VLLMConfig(_Strict):
    """``policy.backend: vllm``: how the engine is sized (``vllm.LLM`` arguments)."""

    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="The engine's weights and compute dtype; null is policy.dtype. On a GPU, "
        "bfloat16 samples while the trained copy keeps policy.dtype (float32 master weights).")
    max_model_len: int = Field(2048, ge=16, description="Longest sequence (prompt + reply) the engine "
                               "serves; at least rollout.max_context_tokens.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="Fraction of the GPU's memory the engine takes for weights "
        "and KV cache; null is vLLM's default (0.9). Leave room for training on the same GPU.")
    enforce_eager: bool = Field(True, description="No CUDA graphs: faster start, slower decoding; "
                                "false on a GPU for long runs.")
    kv_cache_gb: int = Field(2, ge=1, description="CPU builds only: GiB of KV cache "
                             "(VLLM_CPU_KVCACHE_SPACE, unless that is set).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine shards over.")


class PolicyConfig(_Strict):
    backend: Literal["auto", "hf", "vllm", "openai", "mock"] = Field(
        "auto", description="Generation backend; auto is vllm where installed (faster), else hf.")
    model: str = Field("smollm2-135m", description="Registered model name, local folder, or Hugging "
                       "Face Hub id (org/name; downloaded into the Hub cache where online). ~ and $NAME "
                       "expand as in a shell.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="hf: what generation computes in. bf16: autocast with the vocabulary head in "
        "fp32 and keys and values in bf16, what train.precision bf16 computes (the weights stay "
        "policy.dtype); on a Zen 4 CPU with avx512_bf16, make run's evaluation took 58-60 s against 83-86 s "
        "in fp32. auto: in a training run, and in eval, rollout and proxy given a training config, "
        "train.precision as it resolves; given a run's folder or checkpoint as the model, the "
        "train.precision its checkpoint recorded; elsewhere bf16 where the device "
        "multiplies bf16 natively (avx512_bf16 or AMX, a bf16 GPU), else fp32. rollout.deterministic "
        "computes in fp32.")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:N (or mps, xpu, hpu, npu, mlu, musa, xla, ...).")
    max_batch_size: int = Field(16, ge=1, description="Prompts per forward pass.")
    prefix_cache_mb: int = Field(
        4096, ge=0, description="hf: MiB of keys and values kept across turns for prefix reuse; 0 turns it off."
    )
    base_url: str | None = Field(None, description="backend=openai: the server's base URL (ending in /v1).")
    api_key: str | None = Field(None, description="backend=openai: bearer token, if the server wants one.")
    served_model: str | None = Field(
        None, description="backend=openai: the model name the server knows; null is policy.model "
        "(policy.model still names the local tokenizer).")
    mock_responses: list[str] = Field(
        default_factory=lambda: ["1"], min_length=1, description="Scripted answers for backend=mock."
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="backend=vllm: engine sizing.")

    _model_path = field_validator("model")(expand_path)

    @field_validator("device")
    @classmethod
    def _device_form(cls, value: str) -> str:
        """The form only (no torch import here); whether the machine has it is checked when
        the model loads (``agentrl.models.check_device``)."""
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"{value!r} is not a device: use cpu, cuda or cuda:N "
                             f"(or another device type torch knows, such as mps or xpu, with :N)")
        return value


class EnvConfig(_Strict):
    id: str = Field("agentrl/GuessNumber-v0", description="Registered env id; 'module:ns/Name-v0' "
                    "imports module first (gymnasium's form).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword args for the env.")
    imports: list[str] = Field(default_factory=list, description="Modules to import before the env "
                               "is made: those that register_env your own envs.")


MAX_TASKS = 1_000_000
"""The most tasks one ``rollout.episodes`` asks for: the largest real split (WebShop's goals) holds
about 12,000, and a typo (1000000000000) planned its seeds and ran for ever."""


class RolloutConfig(_Strict):
    episodes: int = Field(8, ge=1, description="Tasks to run: env seeds seed, seed+1, ... (at most 1,000,000).")
    group_size: int = Field(1, ge=1, description="Episodes per task for the independent allocator (a GRPO group).")
    allocator: AllocatorOptions = Field(
        default_factory=IndependentOptions, description="Branch allocator (agentrl.rollout.allocators) "
        "and its options: {name: segment_tree, depth: 4, width: 2}; a plain name takes the defaults.")
    budget: int | None = Field(None, ge=1, description="Budget per batch; null is episodes * group_size leaves.")
    budget_unit: Literal["leaves", "turns", "tokens"] = Field("leaves", description="What the budget counts.")
    concurrency: int = Field(64, ge=1, description="Episodes in flight at once.")
    episode_timeout_s: float | None = Field(
        1800.0, gt=0, description="Wall-clock seconds per episode (path), waits for the backend "
        "included; over it the episode fails. null: no limit (one hung env then hangs the batch).")
    env_executor: Literal["thread", "process", "inline", "ray"] = Field(
        "thread", description="Where env steps run: a thread pool; processes for CPU-heavy envs; "
        "inline on the event loop for envs whose steps take microseconds; ray: in env-worker "
        "actors of a Ray cluster (needs the distributed section; agentrl.distributed.env_workers).")
    failed_episodes: Literal["exclude", "zero", "credit"] = Field(
        "exclude", description="Failed episodes in training: left out (exclude), or kept in the "
        "batch with zero advantage (zero); neither enters a baseline. credit: trained as ordinary "
        "episodes with the rewards they earned before failing, baselines included, so a policy whose "
        "output makes episodes fail (a harness that exits non-zero) is pushed away from it, and from "
        "failures it did not cause too. The summary counts them by reason.")
    max_turns: int = Field(16, ge=1, description="Turns per episode before truncation.")
    max_context_tokens: int = Field(2048, ge=16, description="Context budget per episode.")
    seed: Seed = Field(0, description="Episode i uses env seed seed + i.")
    deterministic: bool | None = Field(
        None, description="Same config, seed, machine and torch thread count: the same trees, bit for "
        "bit, whatever the timing, rollout.concurrency or policy.max_batch_size. The policy computes "
        "each request as it would alone (hf: batch-invariant steps, see docs/reproducibility.md). "
        "null: on for mock (free), off for hf (it cost +75% wall time at 32 rows on CPU) and "
        "elsewhere (vllm, openai cannot); true where the backend cannot is an error.")
    system_prompt: str | None = Field(
        "You are an agent acting in a text environment. Reply with the action only.",
        description="System message; null uses the chat template's default.",
    )
    show_admissible: bool = Field(False, description="List admissible actions in observations.")
    constrain: Literal["none", "admissible"] = Field(
        "none", description="admissible: where the env gives info['admissible_actions'], the policy "
        "samples only replies that spell one of them, then end the turn (a token trie, "
        "agentrl.policy.constrain); each turn records its list (Node.admissible) and the trainer "
        "scores under the same mask, so log-probs, entropies and KL are of the constrained "
        "distribution. Turns without a list (or an empty one) sample freely; sampling.stop applies "
        "to those only (it could only cut an action). Needs policy.backend hf or vllm.")
    out_dir: str = Field("runs/rollout", min_length=1,  # "" is the working directory: an unset variable
                         description="Where trajectories and the summary go (~ and $NAME expand "
                         "as in a shell; an unset variable is an error).")
    template_check_every: int = Field(
        8, ge=0, description="Compare the context with a full template re-render on the first two "
        "observations and every N-th after (1: every turn; 0: never); the check grows with the episode.")
    keep_snapshots: bool = Field(
        False, description="Snapshot the env after every turn (Node.snapshot) to branch from."
    )
    record_expert_actions: bool | Literal["expert", "oracle"] = Field(
        False, description="Before each step, ask the env what its scripted expert would do and keep "
        "it in the turn's info['expert_action'] (for an expert teacher): true or 'expert' asks "
        "env.expert_action() (acts on what was observed); 'oracle' asks env.oracle_action() "
        "(privileged: reads hidden state).")
    record_next_context: bool = Field(
        False, description="When max_turns cuts an episode that the env did not end, keep the token "
        "ids the next turn would have read in the last turn's info['next_context_ids'] (a value "
        "head bootstraps GAE from that state).")


    _out_dir = field_validator("out_dir")(expand_path)

    @field_validator("episodes")
    @classmethod
    def _episodes_bounded(cls, value: int) -> int:
        if value > MAX_TASKS:
            raise ValueError(f"{value} tasks: at most {MAX_TASKS:,} (a typo?); a run that large is "
                             "several runs over rollout.seed")
        return value

    @model_validator(mode="before")
    @classmethod
    def _fold_allocator_options(cls, data: Any) -> Any:
        """The old form, ``allocator: NAME`` beside ``allocator_options: {...}``, as the
        new one, with a ``FutureWarning``: it keeps working for one release."""
        old = isinstance(data, dict) and isinstance(data.get("allocator_options"), dict)
        data = folded_options(data, "rollout", "allocator", "independent")
        spec = data.get("allocator") if old else None
        if spec and spec["name"] == "independent" and "n" in spec and spec["n"] is None:
            data["allocator"] = {**spec, "n": "all"}  # the old null: the whole budget, spread
        return data

    @field_validator("allocator", mode="before")
    @classmethod
    def _allocator_by_name(cls, value: Any) -> Any:
        """A plain name is that allocator with its default options; a bad name fails here,
        with the closest valid one, before any model loads."""
        return allocator_spec(value)


class DistributedConfig(_Strict):
    """Scale-out on Ray (``agentrl.distributed``); absent, everything runs in one process."""

    ray: str = Field(
        "auto", min_length=1, description="The Ray cluster: 'auto' joins RAY_ADDRESS, else the cluster "
        "`ray start` recorded on this machine, else starts a private local instance (never another "
        "program's ray.init instance); an address (host:port or ray://host:port) joins that cluster, "
        "and one that does not answer is an error. A process that already called ray.init keeps "
        "its connection.")
    num_env_workers: int = Field(
        2, ge=1, description="Env-worker actors for rollout.env_executor=ray; each hosts env "
        "instances (and a tool env's sandboxes).")
    num_rollout_workers: int = Field(
        0, ge=0, description="Rollout-worker actors, each owning one policy.backend; requests are "
        "load-balanced with prefix-cache affinity. 0: the policy runs in this process.")
    env_worker_cpus: float = Field(1.0, gt=0, description="Ray CPUs one env worker reserves.")
    rollout_worker_cpus: float = Field(1.0, gt=0, description="Ray CPUs one rollout worker reserves.")
    rollout_worker_gpus: float = Field(
        0.0, ge=0, description="Ray GPUs one rollout worker reserves (its backend, vllm or hf, then "
        "runs on them; a fraction shares one GPU between workers). 0 on a CPU machine.")
    @field_validator("env_worker_cpus", "rollout_worker_cpus", "rollout_worker_gpus")
    @classmethod
    def _ray_can_count_it(cls, value: float) -> float:
        """Ray counts resources in units of 0.0001 and refuses a smaller share, when the
        workers start, with a ValueError that names no key."""
        if 0 < value < 0.0001:
            raise ValueError(f"{value:g} is below 0.0001, the smallest share Ray counts")
        return value

    max_restarts: int = Field(
        3, ge=-1, description="Times Ray restarts a dead env or rollout worker (-1: always). The "
        "episodes a dead env worker was running fail with the reason recorded; a dead rollout "
        "worker's requests go to another worker (generate_retries).")
    generate_retries: int = Field(
        2, ge=0, description="Times a request whose rollout worker died is sent to another worker "
        "(or to the same one once restarted, which first loads the current weights); past that "
        "its episode fails with the reason recorded.")
    call_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a rollout worker may take to answer a start, settings or "
        "weights call (a slow-loading model needs more); past it the worker counts as slow "
        "(rollout_workers/slow_calls) and reloads the weights before it serves again.")
    max_failed_starts: int = Field(
        3, ge=1, description="Failed starts in a row (restarts Ray makes while a call waits, or waits "
        "that run out) after which a rollout worker is lost, with the reason; with max_restarts=-1 "
        "a worker that crashes on every start would otherwise be restarted for ever.")
    max_request_deaths: int = Field(
        2, ge=1, description="Rollout-worker deaths one request may be running on: at that many it "
        "fails (its episode records why) instead of going to another worker, whatever generate_retries "
        "is left. A request that kills its worker (an out-of-memory prompt) then takes down this many "
        "workers, not generate_retries + 1; 1 retries no request whose worker died under it.")


class Config(_Strict):
    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)  # sections load_config(ignore=...) dropped
    old_paths: ClassVar[dict[str, str]] = {}
    """Each key that moved or was renamed, its old dotted path to its new one (``train.lr``:
    ``train.optimizer.lr``). The sections' validators still read the old keys; ``load_config``
    also moves them before ``--set`` applies, so that an override of either path replaces the
    file's value at the other instead of sitting beside it (``upgrade_old_keys``)."""

    @classmethod
    def upgrade_old_keys(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A config file's mapping with the values at its old paths (``old_paths``) moved to
        their new ones, before ``--set`` applies."""
        return upgrade_old_paths(data, cls.old_paths)

    @classmethod
    def upgrade_old_override(cls, key: str, data: dict[str, Any]) -> str:
        """The key of a ``--set`` that names an old key ``old_paths`` cannot move alone (one
        folded into a mapping), as today's, given the file's ``data`` (upgraded); else ``key``."""
        return key

    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    distributed: DistributedConfig | None = Field(
        None, description="Ray actors for envs and generation; null runs everything in this process.")

    @model_validator(mode="after")
    def _ray_needs_a_cluster(self) -> Config:
        if self.rollout.env_executor == "ray" and self.distributed is None:
            raise ValueError("rollout.env_executor=ray needs the distributed section "
                             "(e.g. distributed: {ray: auto, num_env_workers: 2})")
        return self

    @model_validator(mode="after")
    def _constrain_needs_a_masking_backend(self) -> Config:
        if self.rollout.constrain != "none" and self.policy.backend in ("openai", "mock"):
            raise ValueError(
                f"rollout.constrain={self.rollout.constrain} needs policy.backend hf or vllm, not "
                f"{self.policy.backend!r}: they mask each step to the admissible-action trie and "
                "return the log-probs of that masked distribution, which the trainer rebuilds")
        return self

    @model_validator(mode="after")
    def _vllm_holds_an_episode(self) -> Config:
        if self.policy.backend == "vllm" and self.policy.vllm.max_model_len < self.rollout.max_context_tokens:
            raise ValueError(f"policy.vllm.max_model_len ({self.policy.vllm.max_model_len}) is below "
                             f"rollout.max_context_tokens ({self.rollout.max_context_tokens}): the engine "
                             "would refuse an episode's late turns; raise policy.vllm.max_model_len")
        return self


C = TypeVar("C", bound="Config")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models a field holds: ``[X]`` for ``X`` or ``X | None``, every variant of a
    union of models (``rollout.allocator``); [] for a plain value."""
    return [a for a in (annotation, *getattr(annotation, "__args__", ()))
            if isinstance(a, type) and issubclass(a, BaseModel)]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The one config model a field holds (``X`` of ``X | None``), else None."""
    models = _models_in(annotation)
    return models[0] if len(models) == 1 else None


def _walk(schema: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """The key path of an error's ``loc``, and the model it ends in (None off the models).
    A union of models told apart by ``name`` puts the name of the variant it tried into
    ``loc`` (``rollout.allocator.segment_tree.depth``); that is no key, so it is left out."""
    keys: list[str] = []
    models = [schema]
    for part in loc:
        tagged = [m for m in models if "name" in m.model_fields and m.model_fields["name"].default == part]
        if len(models) > 1 and len(tagged) == 1:
            models = tagged
            continue
        keys.append(str(part))
        f = models[0].model_fields.get(part) if len(models) == 1 and isinstance(part, str) else None
        models = _models_in(f.annotation) if f is not None else []
    return keys, models[0] if len(models) == 1 else None


def _keys_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys valid where ``loc`` points, and one level below them (``lora.r``); [] off the models."""
    model = _walk(schema, loc)[1]
    if model is None:
        return []
    keys = list(model.model_fields)
    for name, f in model.model_fields.items():
        keys += dict.fromkeys(f"{name}.{k}" for sub in _models_in(f.annotation) for k in sub.model_fields)
    return keys


def _unknown_key(schema: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``unknown key``, with the closest valid keys (difflib, as gymnasium does for env ids)."""
    prefix = "".join(f"{p}." for p in _walk(schema, loc[:-1])[0])
    close = difflib.get_close_matches(str(loc[-1]), _keys_at(schema, loc[:-1]), n=2, cutoff=0.6)
    if not close:
        return "unknown key"
    return f"unknown key (did you mean {' or '.join(repr(prefix + c) for c in close)}?)"


def _read_as(value: Any) -> str:
    """What YAML made of a value that should have been text: 'null', 'the int 83'."""
    return "null" if value is None else f"the {type(value).__name__} {value!r}"


def _format(err: ValidationError, schema: type[BaseModel]) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(_walk(schema, e["loc"])[0]) or "<root>"
        reason = (_unknown_key(schema, e["loc"]) if e["type"] == "extra_forbidden"
                  else e["msg"].removeprefix("Value error, "))
        if e["type"] == "string_type" and (e["input"] is None or isinstance(e["input"], int | float)):
            # YAML reads 0123 as the octal int 83, 1.0 as a float, yes as true and ~ as null
            reason += f" (YAML read the value as {_read_as(e['input'])}: quote it to keep it text)"
        lines.append(f"{path}: {reason}")
    return "invalid config: " + "; ".join(lines)


SHORT_FORMS = {"rollout.allocator", "train.credit"}
"""Keys whose plain string value stands for ``{name: value}``: an override below one
(``rollout.allocator.depth=2`` over ``allocator: segment_tree``) sets a key of that mapping."""


TEXT_MAPPINGS = ("train.harness_env",)
"""Mappings whose values are text (environment variables): an override of one of their keys
(``train.harness_env.FOO=0123``) keeps its value as written, where YAML would read 0123 as the
int 83, ``on`` as true and ``1.0e3`` as 1000.0, and the harness would get that other text."""


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for i, key in enumerate(keys[:-1]):
        nxt = cur.setdefault(key, {})
        if nxt is None:  # an empty or null section (``train:`` with its keys commented out) takes keys
            nxt = cur[key] = {}
        if isinstance(nxt, str) and ".".join(keys[:i + 1]) in SHORT_FORMS:
            nxt = cur[key] = {"name": nxt}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(keys[:i + 1])}: is a value, cannot set {dotted}")
        cur = nxt
    cur[keys[-1]] = value


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one mapping."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: YAML keeps the last,
    and a second ``train:`` section silently replaced the whole first one."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: keys given here override it
            continue
        key, line = loader.construct_object(key_node, deep=deep), key_node.start_mark.line
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if first is not None:
            raise _DuplicateKey(
                None, None, f"{key!r} given twice (lines {first + 1} and {line + 1})", key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load`` of a config's text, refusing a key given twice in one mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


_NULLS = ("null", "Null", "NULL", "~")


def _override_value(raw: str) -> Any:
    """An override's value, read as YAML (``1``, ``true``, ``null``, ``[a]``, ``{k: v}``, ``'quoted'``);
    plain text that YAML would read as something else stays as written: ``Reply: with the action``
    (a mapping), ``Call tool #1 first`` (cut at the comment) and ``- step`` (a list), which a
    system prompt or a path holds. Raises ``_DuplicateKey``."""
    if not raw:
        return ""
    try:
        value = _load_yaml(raw)
    except _DuplicateKey:
        raise
    except yaml.YAMLError:
        return raw
    if raw.lstrip()[:1] in ("[", "{", "'", '"'):  # a flow collection or a quoted string: as YAML says
        return value
    if isinstance(value, dict | list) or (value is None and raw.strip() not in _NULLS) or (
            isinstance(value, str) and value != raw.strip()):
        return raw
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings; values are read as YAML (``_override_value``), but
    those of a key of ``TEXT_MAPPINGS`` stay text."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = _override_value(raw)
        except _DuplicateKey as e:  # not text to take as it is: the YAML says two things
            raise ConfigError(f"override {item!r}: {e.problem}") from None
        if not isinstance(value, str) and key.strip().rpartition(".")[0] in TEXT_MAPPINGS:
            value = raw  # quoted ('0123'), YAML's text is kept: the quotes go, as for any key
        _set_path(data, key.strip(), value)
    return data


def _quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar, which reads back as the same text whatever it
    holds (JSON's quoting split a character past U+FFFF into two halves that YAML kept apart)."""
    return yaml.safe_dump(text, default_style='"', width=float("inf"), allow_unicode=True).rstrip("\n")


def flag_overrides(flags: dict[str, Any]) -> list[str]:
    """The ``key.path=value`` overrides of a command's flags (``{"rollout.out_dir": out}``;
    None: not given). Text is quoted, so that YAML reads it back as the same text: read as
    YAML, ``--out 2024`` was the int 2024 (refused: not text) and ``--model 0123`` the int 83."""
    return [f"{key}={_quoted(v) if isinstance(v, str) else v}" for key, v in flags.items() if v is not None]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release: use {new}",
                  FutureWarning, stacklevel=4)


def _pop_path(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """Remove the value at ``dotted`` from nested mappings: (whether it was there, the value)."""
    *parents, leaf = dotted.split(".")
    cur: Any = data
    for key in parents:
        cur = cur.get(key) if isinstance(cur, dict) else None
    if not isinstance(cur, dict) or leaf not in cur:
        return False, None
    return True, cur.pop(leaf)


def _has_path(data: dict[str, Any], dotted: str) -> bool:
    cur: Any = data
    for key in dotted.split("."):
        if not isinstance(cur, dict) or key not in cur:
            return False
        cur = cur[key]
    return True


def upgrade_old_paths(data: dict[str, Any], old_paths: dict[str, str]) -> dict[str, Any]:
    """``data`` (a config file's mapping) with the value at each old path of ``old_paths``
    moved to its new path, with the ``FutureWarning`` its section's validator would give. Both
    given stay as they are: the validator names them."""
    for old, new in old_paths.items():
        if _has_path(data, old) and not _has_path(data, new):
            parent = new.rsplit(".", 1)[0]
            if "." in new and _has_path(data, parent) and not isinstance(_at_path(data, parent), dict):
                continue  # a section given as a value: the validator names it
            _deprecated(old, new)
            _set_path(data, new, _pop_path(data, old)[1])
    return data


def _at_path(data: dict[str, Any], dotted: str) -> Any:
    cur: Any = data
    for key in dotted.split("."):
        cur = cur[key]
    return cur


def _apply_moving_old_paths(data: dict[str, Any], overrides: list[str], schema: type[Config]) -> None:
    """``apply_overrides``, with each key at or below an old path of ``schema.old_paths`` moved
    to its new path first, with a ``FutureWarning``, so that ``--set train.lr=...`` replaces a
    file's ``train.optimizer.lr``. An old and a new path of one key both set here is an error."""
    old_paths = schema.old_paths
    moved: dict[str, str] = {}
    given: set[str] = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = schema.upgrade_old_override(key.strip(), data)
        item = f"{key}{sep}{raw}" if sep else item
        old = next((o for o in old_paths if key == o or key.startswith(o + ".")), None)
        parent = old_paths[old].rsplit(".", 1)[0] if old else ""
        if old and not (_has_path(data, parent) and not isinstance(_at_path(data, parent), dict)):
            _deprecated(old, old_paths[old])
            moved[old_paths[old]] = old
            item = f"{old_paths[old]}{key[len(old):]}{sep}{raw}"
        else:  # not old, or its new section given as a value: the validator names it
            given.add(key)
        apply_overrides(data, [item])
    for new, old in moved.items():
        if new in given:
            raise ConfigError(f"{old} is the old place of {new}: give only {new}")


def ignored_section(cfg: Config, name: str) -> dict[str, Any]:
    """The section ``name`` (``train``, ``sft``) that ``load_config(ignore=...)`` dropped from
    ``cfg``, as the file and ``--set`` gave it; ``{}`` where it had none. ``eval``, ``rollout``
    and ``proxy`` read a training config's ``train.precision`` here, without reading the file
    again (a FIFO reads once)."""
    section = cfg._ignored.get(name)
    return section if isinstance(section, dict) else {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                schema: type[C] = Config, ignore: tuple[str, ...] = ()) -> C:  # type: ignore[assignment]
    """Read YAML (if given), apply overrides, validate against ``schema`` (a ``Config``
    subclass adds sections, as the trainer's does). ``ignore``: top-level sections of other
    commands, dropped unread (``agentrl eval`` and ``rollout`` read a train config's run
    sections, not its ``train`` and ``sft``), so one file serves every command. Raises ``ConfigError``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = _load_yaml(Path(path).read_text(encoding="utf-8"))  # YAML's own, whatever the locale
        except UnicodeDecodeError as e:  # an editor's Latin-1, say: a ValueError, which escaped as a traceback
            raise ConfigError(f"cannot read config {path}: it is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                              f"at offset {e.start}); save it as UTF-8") from None
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = schema.upgrade_old_keys(data)
    _apply_moving_old_paths(data, overrides or [], schema)
    dropped = {section: data.pop(section) for section in ignore if section in data}
    try:
        cfg = schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, schema)) from None
    cfg._ignored = dropped
    return cfg
