import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs of a minute or more")
    config.addinivalue_line("markers", "vllm: needs vLLM (make setup-vllm); skipped without it")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A small random Qwen2 model with the bundled character tokenizer, built locally (no downloads)."""
    import transformers

    from grpo.tiny import build_char_tokenizer, tiny_model_config

    transformers.utils.logging.disable_progress_bar()
    tok = build_char_tokenizer()
    cfg = tiny_model_config(tok, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("random-tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
