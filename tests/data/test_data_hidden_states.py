import json
import shutil
from collections import Counter

import pytest
import torch
from conftest import CONVERSATIONS, build_model, write_jsonl

from pr_specforge.data.hidden_states import (
    FeatureDirMismatch,
    SGLangCapture,
    TransformersCapture,
    default_aux_layers,
    feature_path,
    prepare_hidden_states,
)
from pr_specforge.data.templates import ChatTemplateError, tokenize_conversation
from pr_specforge.data.validate import validate_features
from pr_specforge.data.vocab import build_vocab_mapping, draft_to_target, load_vocab_mapping


def run(tmp, target, tokenizer, model, out="feat", rows=CONVERSATIONS, **kw):
    src = write_jsonl(tmp / "conv.jsonl", rows)
    kw.setdefault("draft_vocab_size", 40)
    kw.setdefault("batch_size", 2)
    capture = kw.pop("capture", None) or TransformersCapture(model, default_aux_layers(8))
    stats = prepare_hidden_states(src, tmp / out, str(target), "smollm2", capture=capture, tokenizer=tokenizer,
                                  progress=False, **kw)
    return stats, tmp / out


def load(path):
    return torch.load(path, weights_only=True)


def test_features_equal_a_direct_forward_at_the_specforge_layers(tmp_path, tiny_target, tokenizer, tiny_model):
    stats, out = run(tmp_path, tiny_target, tokenizer, tiny_model)
    assert stats.written == len(CONVERSATIONS)
    for idx in range(len(CONVERSATIONS)):
        d = load(feature_path(out, idx))
        assert d["input_ids"].dtype == torch.long and d["input_ids"].dim() == 1
        with torch.no_grad():  # unbatched reference through the full CausalLM
            ref = tiny_model(d["input_ids"][None], output_hidden_states=True)
        hs = ref.hidden_states
        # layer OUTPUTS 1, L//2-1, L-4 of an 8-layer model = HF hidden_states[2], [4], [5]
        aux = torch.cat([hs[2], hs[4], hs[5]], dim=-1)
        torch.testing.assert_close(d["aux_hidden_state"], aux, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(d["hidden_state"], hs[-1], rtol=1e-4, atol=1e-5)  # post-norm
        # the stored final state reproduces the target's logits through its lm_head
        torch.testing.assert_close(tiny_model.lm_head(d["hidden_state"]), ref.logits, rtol=1e-4, atol=1e-4)


def test_aux_layer_override_is_recorded_and_used(tmp_path, tiny_target, tokenizer, tiny_model):
    cap = TransformersCapture(tiny_model, [0, 5, 6])
    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model, capture=cap, rows=CONVERSATIONS[:1])
    d = load(feature_path(out, 0))
    with torch.no_grad():
        hs = tiny_model(d["input_ids"][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(d["aux_hidden_state"], torch.cat([hs[1], hs[6], hs[7]], -1), rtol=1e-4, atol=1e-5)
    assert json.loads((out / "manifest.json").read_text())["target"]["aux_layers"] == [0, 5, 6]


def test_loss_mask_covers_exactly_each_reply_and_its_end_of_turn(tokenizer):
    conv = CONVERSATIONS[1]["conversations"]
    s = tokenize_conversation(tokenizer, conv, "smollm2", 2048)
    ids, mask = s.input_ids, s.loss_mask.bool()
    # contiguous supervised spans, one per assistant turn, each decoding to reply + "<|im_end|>\n"
    spans, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tokenizer.decode(ids[start:i]))
            start = None
    assert spans == [m["content"] + "<|im_end|>\n" for m in conv if m["role"] == "assistant"]
    # and everything before the first reply (system, user, headers) is unsupervised
    text = tokenizer.decode(ids[: int(mask.nonzero()[0])])
    assert text.endswith("<|im_start|>assistant\n") and "Write a poem" in text


def test_default_system_prompt_is_added_like_the_hf_template(tokenizer):
    conv = CONVERSATIONS[0]["conversations"]
    s = tokenize_conversation(tokenizer, conv, "smollm2", 2048)
    assert tokenizer.decode(s.input_ids) == tokenizer.apply_chat_template(conv, tokenize=False)


def test_vocab_map_round_trips_and_matches_specforge(tmp_path, tiny_target, tokenizer, tiny_model):
    from specforge.data.preprocessing import process_token_dict_to_mappings

    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model)
    m = load_vocab_mapping(out)
    assert m["t2d"].dtype == torch.bool and m["d2t"].dtype == torch.long and len(m["d2t"]) == 40
    targets = draft_to_target(m)
    assert torch.equal(m["t2d"].nonzero().squeeze(-1), targets)  # draft id + d2t == target id, sorted
    counts = Counter()
    for idx in range(len(CONVERSATIONS)):
        d = load(feature_path(out, idx))
        counts.update(d["input_ids"][d["loss_mask"].bool()].tolist())
    assert set(counts) <= set(targets.tolist())  # 40 > distinct loss tokens: all covered
    # same construction as SpecForge's own (including its zero-count padding)
    counts = Counter({5: 9, 17: 4, 3: 4, 200: 1, 42: 7})
    d2t, t2d = process_token_dict_to_mappings(Counter(counts), 8, 300)
    ours = build_vocab_mapping(counts, 8, 300)
    assert torch.equal(ours["d2t"], d2t) and torch.equal(ours["t2d"], t2d)
    top = build_vocab_mapping(counts, 3, 300)
    assert draft_to_target(top).tolist() == [5, 17, 42]  # ties keep first-seen order, as Counter does


def test_resume_after_interruption_gives_the_same_features(tmp_path, tiny_target, tokenizer, tiny_model):
    _, full = run(tmp_path, tiny_target, tokenizer, tiny_model, out="full")

    class Crash(TransformersCapture):
        calls = 0

        def capture(self, batch):
            Crash.calls += 1
            if Crash.calls == 2:
                raise KeyboardInterrupt
            return super().capture(batch)

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, tiny_target, tokenizer, tiny_model, out="part", capture=Crash(tiny_model, default_aux_layers(8)))
    done = sorted((tmp_path / "part").rglob("data_*.ckpt"))
    assert 0 < len(done) < len(CONVERSATIONS)
    assert not list((tmp_path / "part").rglob("*.tmp"))  # atomic writes leave no partial file
    stats, part = run(tmp_path, tiny_target, tokenizer, tiny_model, out="part")
    assert stats.resumed == len(done) and stats.resumed + stats.written == len(CONVERSATIONS)
    for idx in range(len(CONVERSATIONS)):
        a, b = load(feature_path(full, idx)), load(feature_path(part, idx))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["hidden_state"], b["hidden_state"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["aux_hidden_state"], b["aux_hidden_state"], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(load_vocab_mapping(full).values(), load_vocab_mapping(part).values()))


def test_output_dir_of_another_target_is_refused(tmp_path, tiny_target, tokenizer, tiny_model):
    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model, rows=CONVERSATIONS[:2])
    other = tmp_path / "other_target"
    shutil.copytree(tiny_target, other)
    with pytest.raises(FeatureDirMismatch, match=r"manifest\.json: field 'target\.path'"):
        run(tmp_path, other, tokenizer, tiny_model, rows=CONVERSATIONS[:2])
    wide = build_model(len(tokenizer), hidden_size=48)
    with pytest.raises(FeatureDirMismatch, match=r"field 'target\.hidden_size' is 32 .* 48"):
        run(tmp_path, tiny_target, tokenizer, wide, rows=CONVERSATIONS[:2], capture=TransformersCapture(wide, [1, 3, 4]))
    # features without a manifest: the hidden size of an existing file decides
    (out / "manifest.json").unlink()
    with pytest.raises(FeatureDirMismatch, match=r"data_0\.ckpt: field 'hidden_state' has hidden size 32"):
        run(tmp_path, tiny_target, tokenizer, wide, rows=CONVERSATIONS[:2], capture=TransformersCapture(wide, [1, 3, 4]))


def test_rows_without_loss_tokens_are_counted_not_written(tmp_path, tiny_target, tokenizer, tiny_model):
    rows = CONVERSATIONS[:1] + [{"id": "q", "conversations": [{"role": "user", "content": "unanswered"}]},
                                {"id": "z", "conversations": []}]
    stats, out = run(tmp_path, tiny_target, tokenizer, tiny_model, rows=rows)
    assert stats.written == 1 and stats.skipped == {"no_loss_tokens": 1, "no_conversation": 1}
    assert feature_path(out, 0).exists() and not feature_path(out, 1).exists()


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path, tiny_target, tokenizer, tiny_model):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        run(tmp_path, tiny_target, bare, tiny_model)


def test_specforge_offline_reader_and_normalizer_read_our_features(tmp_path, tiny_target, tokenizer, tiny_model):
    from specforge.algorithms.eagle3.data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model)
    refs = build_offline_reader(str(out), run_id="t", ttt_length=7, max_len=64).read()
    assert len(refs) == len(CONVERSATIONS)  # vocab_mapping.pt and manifest.json are not picked up
    raw = load_feature_file(refs[0].feature_store_uri[len("file://"):])
    batch = normalize_offline_sample(raw, max_len=64)
    L = min(64, raw["input_ids"].numel())
    assert batch["hidden_state"].shape == (1, L, 96) and batch["target"].shape == (1, L, 32)


def test_validator_reports_bad_files_by_name(tmp_path, tiny_target, tokenizer, tiny_model):
    from pr_specforge.data.cli import main

    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model)
    assert validate_features(out).ok
    assert main(["validate", str(out), "--target", str(tiny_target)]) == 0
    d = load(feature_path(out, 1))
    d["loss_mask"].zero_()
    torch.save(d, feature_path(out, 1))
    d = load(feature_path(out, 2))
    d["aux_hidden_state"] = d["aux_hidden_state"][..., :64]
    torch.save(d, feature_path(out, 2))
    feature_path(out, 3).write_bytes(b"not a checkpoint")
    d = load(feature_path(out, 4))
    d["input_ids"][0] = 10_000
    torch.save(d, feature_path(out, 4))
    report = validate_features(out)
    assert {p.rsplit("/", 1)[-1]: r.split(" ")[0] for p, r in report.bad.items()} == {
        "data_1.ckpt": "empty", "data_2.ckpt": "aux_hidden_state", "data_3.ckpt": "does", "data_4.ckpt": "input_ids"}
    assert main(["validate", str(out)]) == 1


def test_validator_checks_the_vocab_map(tmp_path, tiny_target, tokenizer, tiny_model):
    _, out = run(tmp_path, tiny_target, tokenizer, tiny_model)
    m = load_vocab_mapping(out)
    m["t2d"][int(draft_to_target(m)[0])] = False
    torch.save(m, out / "vocab_mapping" / "vocab_mapping.pt")
    report = validate_features(out)
    assert not report.ok and any("t2d does not mark" in p for p in report.problems)


def test_sglang_backend_without_gpu_is_a_clear_error(tiny_target):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(RuntimeError, match=r"needs a CUDA GPU .*torch\.cuda\.current_device\(\)"):  # what SpecForge's backend lacks
        SGLangCapture(str(tiny_target), None)
