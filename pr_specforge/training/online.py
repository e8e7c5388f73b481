"""Online training: the target runs inside every training rank, no feature files.

    data:
      online: true                                       # ours: read by training.recipe, not SpecForge
      train_data_path: work/smollm2/regenerated.jsonl    # SpecForge's own field for raw conversations
      chat_template: smollm2
      max_length: 512
      online_dtype: bfloat16                             # ours: the target's dtype (as `data hidden-states`); its
                                                         # states reach the drafter in model.torch_dtype

SpecForge 0.2.0 dropped colocated online training (its online mode is an
external SGLang server plus Mooncake). We keep its colocated offline runtime
(sampler, resume seek, DDP / DeepSpeed, checkpoints) and change only what a
sample is:

- the reader lists conversations (`conv://<jsonl>#<row>` refs), tokenised
  once per rank by `tokenized_rows`, the same code and skip rules as
  `data hidden-states`;
- the store (`ConversationFeatureStore`, a `LocalFeatureStore` installed for
  the run) serves their `input_ids` / `loss_mask`; directories of feature
  files (held-out eval) are still served from disk;
- the strategy (SpecForge's `eagle3` or our `pr`, subclassed) runs the target
  on each batch through `TransformersCapture.forward` (the code that writes
  offline files) for the aux and final hidden states; the parent's frozen
  `TargetHead` turns the final state into the teacher distribution exactly as
  it does offline. The target is frozen (eval, inference mode) and lives
  outside the wrapped model: never optimised, never checkpointed.

This module owns the online runtime only: the recipe keys are read by `training.recipe`
(`OnlineSettings`), the pre-flight checks of the files made by `training.preflight`.

Telemetry: `online/target_s` (seconds of target forward per step) and
`online/target_share` (target seconds over wall seconds between consecutive
steps, measured over the previous step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections import Counter
from typing import Any, Dict, Optional, Tuple

import torch

from pr_specforge import _specforge as sf
from pr_specforge._specforge import Eagle3TrainStrategy, LocalFeatureStore, OfflineManifestReader
from pr_specforge.config import ConfigError
from pr_specforge.training.recipe import ONLINE_STRATEGIES, OnlineSettings
from pr_specforge.training.registration import PRTrainStrategy

log = logging.getLogger(__name__)

SCHEME = "conv://"
FEATURE_KEYS = ("input_ids", "loss_mask")

#: abs conversations path -> (tokenisation key, {row index: (input_ids int32, loss_mask uint8)});
#: shared by the reader and the store of one process (the loader's prefetch workers are threads).
_SAMPLES: Dict[str, Tuple[tuple, Dict[int, Tuple[torch.Tensor, torch.Tensor]]]] = {}


# ------------------------------------------------------------------ data


def conversation_samples(settings: OnlineSettings) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Tokenise the conversations once per process (same rows, ids and masks as `data hidden-states`)."""
    key = (settings.target_path, settings.chat_template, settings.max_length)
    cached = _SAMPLES.get(settings.conversations)
    if cached is not None and cached[0] == key:
        return cached[1]
    from transformers import AutoConfig, AutoTokenizer

    from pr_specforge.data.hidden_states import HiddenStateStats, _text_config, tokenized_rows
    from pr_specforge.data.templates import check_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.target_path)
    check_tokenizer(tokenizer, settings.chat_template)
    vocab = int(_text_config(AutoConfig.from_pretrained(settings.target_path)).vocab_size)
    stats = HiddenStateStats()
    rows = {idx: (s.input_ids.to(torch.int32), s.loss_mask.to(torch.uint8))
            for idx, s in tokenized_rows(settings.conversations, tokenizer, settings.chat_template,
                                         settings.max_length, vocab, stats)}
    if not rows:
        raise ConfigError(f"data.train_data_path: {settings.conversations}: no trainable conversation ({stats.as_dict()})")
    log.info("online: %d conversations tokenised, %d tokens (%s skipped)", len(rows), stats.tokens, dict(stats.skipped))
    _SAMPLES[settings.conversations] = (key, rows)
    return rows


def prepare_vocab_mapping(config, settings: OnlineSettings) -> str:
    """The draft vocab map of the conversations' loss tokens, written under the run dir (same rule as
    `data hidden-states`); each rank writes the same bytes atomically. Returns its path."""
    from pr_specforge.data.vocab import VOCAB_MAPPING_RELPATH, build_vocab_mapping, count_loss_tokens, save_vocab_mapping

    with open(config.model.draft_model_config) as f:
        draft = json.load(f)
    counts: Counter = Counter()
    for ids, mask in conversation_samples(settings).values():
        count_loss_tokens(counts, ids.long(), mask.long())
    from transformers import AutoConfig

    from pr_specforge.data.hidden_states import _text_config

    vocab = int(_text_config(AutoConfig.from_pretrained(settings.target_path)).vocab_size)
    mapping = build_vocab_mapping(counts, int(draft["draft_vocab_size"]), vocab)
    path = os.path.join(config.output_dir, "online_vocab", VOCAB_MAPPING_RELPATH)
    if os.path.isfile(path) and _same_mapping(path, mapping):
        return path  # untouched: SpecForge's resume check compares the file's stat
    scratch = os.path.join(os.path.dirname(path), f".rank{os.environ.get('RANK', '0')}")
    save_vocab_mapping(mapping, scratch)
    try:  # the first rank to link it wins; the others hold the same bytes
        os.link(os.path.join(scratch, VOCAB_MAPPING_RELPATH), path)
    except FileExistsError:
        if os.path.getsize(path) == 0 or not _same_mapping(path, mapping):
            os.replace(os.path.join(scratch, VOCAB_MAPPING_RELPATH), path)
    shutil.rmtree(scratch, ignore_errors=True)
    return path


def _same_mapping(path: str, mapping) -> bool:
    old = torch.load(path, map_location="cpu", weights_only=True)
    return all(torch.equal(old[k], mapping[k]) for k in ("t2d", "d2t"))


class ConversationReader(OfflineManifestReader):
    """One `conv://` ref per tokenised conversation, in file order (SpecForge's sampler shuffles)."""

    def __init__(self, path: str, samples: Dict[int, Any], **kwargs):
        super().__init__(path, feature_keys=FEATURE_KEYS, validate_files=False, **kwargs)
        self.samples = samples

    def __iter__(self):
        from pr_specforge.data.hidden_states import feature_path

        path = os.path.abspath(self.hidden_states_path)
        # the order SpecForge lists `data hidden-states` files in (sorted paths), so an online run
        # visits the samples an offline run over the same conversations visits, in the same order
        rows = sorted(self.samples, key=lambda row: str(feature_path("", row)))
        for index, row in enumerate(rows):
            ref = sf.reader_sample_ref(self, index, f"{path}#{row}")
            yield dataclasses.replace(ref, feature_store_uri=f"{SCHEME}{path}#{row}")


class ConversationFeatureStore(LocalFeatureStore):
    """SpecForge's local store, plus `conv://` refs served from the tokenised conversations."""

    def get(self, sample_ref, *, device="cpu", names=None):
        uri = sample_ref.feature_store_uri
        if not uri.startswith(SCHEME):
            return super().get(sample_ref, device=device, names=names)
        path, row = uri[len(SCHEME):].rsplit("#", 1)
        ids, mask = _SAMPLES[path][1][int(row)]
        tensors = {"input_ids": ids.long(), "loss_mask": mask.long()}
        tensors = {k: tensors[k].to(device) for k in (names or FEATURE_KEYS)}
        return tensors, sf.lease_sample(self, sample_ref)


def normalize_online_sample(raw, max_len: int):
    """SpecForge's EAGLE-3 offline normalisation (truncate, last position unsupervised), tokens only."""
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    if loss_mask.numel() > 0:
        loss_mask[0, -1] = 0
    return {"attention_mask": torch.ones_like(loss_mask, dtype=torch.long), "loss_mask": loss_mask, "input_ids": input_ids}


# ------------------------------------------------------------------ the step


class OnlineTargetMixin:
    """Fills `hidden_state` (aux) and `target` (final hidden) of a tokens-only batch by running the target."""

    online_settings: Optional[OnlineSettings] = None
    _capture = None
    _last: Tuple[float, float] = (0.0, 0.0)  # (target seconds, wall start) of the previous step

    def forward_loss(self, batch, ctx=None):
        start = time.perf_counter()
        t = batch.tensors
        target_s = self.run_target(t) if t.get("hidden_state") is None else 0.0
        out = super().forward_loss(batch, ctx)
        prev_target, prev_start = self._last
        share = (prev_target, start - prev_start) if prev_start else (0.0, 1.0)
        self._last = (target_s, start)
        out.metrics["online/target_s"] = torch.tensor(target_s)
        out.ratio_metrics["online/target_share"] = tuple(torch.tensor(float(x)) for x in share)
        return out

    def target_capture(self):
        if self._capture is None:
            from pr_specforge.data.hidden_states import TransformersCapture

            s = self.online_settings
            self._capture = TransformersCapture.from_pretrained(
                s.target_path, list(s.aux_layers) if s.aux_layers else None, dtype=s.dtype, device=str(sf.strategy_device(self)))
        return self._capture

    def run_target(self, tensors: Dict[str, Any]) -> float:
        """Aux + final hidden states of the batch, padding zeroed as SpecForge's collator pads stored
        features; returns the seconds the target took. The global RNG streams are left untouched
        (loading a model draws from them), so PR's sampled halt depths match an offline run's."""
        device = sf.strategy_device(self)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            capture = self.target_capture()
            _sync(device)
            t0 = time.perf_counter()
            final, aux = capture.forward(tensors["input_ids"], tensors["attention_mask"])
            keep = tensors["attention_mask"].to(final.device)[..., None].to(final.dtype)
            # in the drafter's dtype, as its TargetHead and layers compute (data.online_dtype may differ)
            dtype = next(self.trainable_module().parameters()).dtype
            tensors["target"], tensors["hidden_state"] = (final * keep).to(dtype), (aux * keep).to(dtype)
            _sync(device)
        return time.perf_counter() - t0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class OnlineEagle3TrainStrategy(OnlineTargetMixin, Eagle3TrainStrategy):
    """SpecForge's EAGLE-3 step with the target in the loop."""


class OnlinePRTrainStrategy(OnlineTargetMixin, PRTrainStrategy):
    """The PR step with the target in the loop."""


ONLINE_CLASSES = {"eagle3": OnlineEagle3TrainStrategy, "pr": OnlinePRTrainStrategy}
assert set(ONLINE_CLASSES) == set(ONLINE_STRATEGIES)  # the strategies `training.recipe` accepts online


# ------------------------------------------------------------------ wiring


def online_registration(registration, settings: OnlineSettings):
    """`registration` with the online step and the conversation reader / normaliser."""
    from pr_specforge._specforge import make_registration

    cls = ONLINE_CLASSES[registration.name]
    base = registration.providers

    def build_step(wrapped_model, *, target_head=None, **options):
        strategy = cls(wrapped_model, target_head=target_head, **options)
        strategy.online_settings = settings
        return strategy

    def with_conversations(offline):
        def build_reader(path, *, run_id, ttt_length, max_len):
            if os.path.isdir(path):  # held-out eval features on disk
                return offline.build_reader(path, run_id=run_id, ttt_length=ttt_length, max_len=max_len)
            return ConversationReader(path, conversation_samples(settings), run_id=run_id, strategy=registration.name,
                                      ttt_length=ttt_length, max_len=max_len, target_repr="hidden_state")

        def build_normalizer(max_len, *, ttt_length=1, use_usp_preprocess=False):
            if use_usp_preprocess:
                raise ConfigError("data.online=true does not support training.attention_backend=usp")
            stored = offline.build_normalizer(max_len, ttt_length=ttt_length, use_usp_preprocess=False)
            return lambda raw: stored(raw) if "hidden_state" in raw else normalize_online_sample(raw, max_len)

        def build_collator():  # SpecForge's padding collator; tokens-only batches carry no None features
            collate = offline.build_collator()
            return lambda features: {k: v for k, v in collate(features).items() if v is not None}

        return dataclasses.replace(offline, build_reader=build_reader, build_normalizer=build_normalizer,
                                   build_collator=build_collator)

    providers = dataclasses.replace(base, step=dataclasses.replace(base.step, build=build_step),
                                    offline=tuple(with_conversations(o) for o in base.offline))
    return make_registration(registration.spec, providers)


def online_registry(registry, settings: OnlineSettings, strategy: str):
    """`registry` with `strategy`'s registration made online."""
    from pr_specforge._specforge import AlgorithmRegistry

    return AlgorithmRegistry(tuple(online_registration(r, settings) if r.name == strategy else r for r in registry))


def resolve_aux_layers(config, settings: OnlineSettings) -> OnlineSettings:
    """SpecForge's capture-layer rule (run override, draft `eagle_config`, else `[1, L//2-1, L-4]`)."""
    from transformers import AutoConfig

    from pr_specforge._specforge import resolve_eagle_capture_layers

    with open(config.model.draft_model_config) as f:
        draft = json.load(f)
    layers = resolve_eagle_capture_layers(config, draft, AutoConfig.from_pretrained(settings.target_path))
    return dataclasses.replace(settings, aux_layers=tuple(layers))


def prepare_online_run(config, settings: OnlineSettings, registry):
    """`(config, registry)` for an online run: vocab map (unless given), capture layers, the online
    registration, and the conversation store installed in SpecForge's launcher."""
    from pr_specforge._specforge import use_feature_store

    if not config.model.vocab_mapping_path:
        config = config.model_copy(update={"model": config.model.model_copy(
            update={"vocab_mapping_path": prepare_vocab_mapping(config, settings)})})
    settings = resolve_aux_layers(config, settings)
    conversation_samples(settings)  # tokenise before the trainer's clock starts
    use_feature_store(ConversationFeatureStore)
    return config, online_registry(registry, settings, config.training.strategy)
