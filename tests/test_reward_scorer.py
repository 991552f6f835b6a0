"""RewardScorer: rule, remote HTTP (a real local server) and model rewards, combined."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from actors.core.reward import HttpReward, ModelReward, RewardScorer


class _LengthReward(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 (http.server's naming)
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        payload = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LengthReward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_weighted_terms_combine_and_normalise(reward_server):
    scorer = RewardScorer([("exact_match", 1.0), (reward_server, 0.5)], normalize=False)
    out = scorer.score(["1+1=", "1+1="], ["2", "11"], answer=["2", "2"])
    np.testing.assert_allclose(out, [1.0 + 0.5 * 1, 0.0 + 0.5 * 2])
    normalised = RewardScorer([("exact_match", 1.0)], normalize=True).score(["a", "b"], ["2", "3"], answer=["2", "2"])
    np.testing.assert_allclose(normalised, [1.0, -1.0])


def test_a_sample_no_term_scores_is_unscored_not_zero():
    """None from every term: NaN (unscored), not 0 normalised to the floor -1; None from one term
    of two: that term is left out of the sum."""
    scorer = RewardScorer([("exact_match", 1.0), ("answer_format", 0.5)], normalize=True, value_range=(0.0, 1.5))
    fields = {"answer": ["2", None, None]}
    out = scorer.score(["1+1=", "x", "y"], ["2", "a b", "ok"], **fields)
    np.testing.assert_allclose(out, [1.0, -1.0, 2 * 0.5 / 1.5 - 1])  # the second: format 0 (scored), exact_match None
    only_exact = RewardScorer([("exact_match", 1.0)], normalize=True)
    assert np.isnan(only_exact.score(["p", "q"], ["2", "3"], answer=[None, "3"])).tolist() == [True, False]
    assert only_exact.scores_by_term(["p"], ["2"], answer=[None])["combined"] == [None]


@pytest.mark.parametrize("bad", ["float('nan')", "float('inf')"])
def test_a_reward_that_returns_a_non_finite_value_is_named(tmp_path, bad):
    """NaN or inf from a reward is an error naming it (None is how a reward says "not scored"):
    inf would turn its whole group's advantages into NaN."""
    path = tmp_path / "odd.py"
    path.write_text(f"def reward(prompts, completions, **fields):\n    return [1.0, {bad}]\n")
    with pytest.raises(ValueError, match=r"odd.py:reward' returned (nan|inf) at index 1; return a finite float, or None"):
        RewardScorer([(f"{path}:reward", 1.0)]).score(["p", "q"], ["c", "d"])


def test_unreachable_reward_url_fails_naming_it_after_retries():
    with __import__("socket").socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    reward = HttpReward(url, timeout_s=0.5, retries=2, backoff_s=0.01)
    with pytest.raises(RuntimeError, match=rf"{url} failed after 3 tries"):
        reward(["p"], ["c"])
    scorer = RewardScorer([(url, 1.0)])
    scorer.terms = [(url, 1.0, reward)]
    with pytest.raises(RuntimeError, match="failed after 3 tries"):
        scorer.score(["p"], ["c"])


def test_reward_file_that_raises_is_named(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def reward(prompts, completions, **fields):\n    return 1 / 0\n")
    scorer = RewardScorer([(f"{path}:reward", 1.0)])
    with pytest.raises(RuntimeError, match=r"bad.py:reward' raised ZeroDivisionError"):
        scorer.score(["p"], ["c"])


def test_model_reward_scores_with_a_sequence_classifier(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from pipelines.models.tiny import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
    )
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reward = ModelReward(str(tmp_path))
    scores = reward(["1+1=", "1+1=", "1+1="], ["2", "3", "2"])
    assert len(scores) == 3 and all(np.isfinite(scores))
    assert scores[0] == pytest.approx(scores[2]) and scores[0] != pytest.approx(scores[1])
