"""Test helper: a tiny random Qwen3 checkpoint whose tokenizer has `<think>` and `</think>` as added (not special)
tokens, as Qwen3's and DeepSeek-R1's have, and whose chat template opens the thinking after the generation prompt
when `thinking` is true (DeepSeek's way: the output starts inside the reasoning) and otherwise leaves it to the model
(Qwen3's way)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.hf_checkpoints import make_hf_checkpoint

THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% if thinking is defined and thinking %}<think>\n{% endif %}{% endif %}")


def make_think_checkpoint(folder: Path, tiny: Path) -> tuple[Path, int, int]:
    """(checkpoint folder, id of <think>, id of </think>)."""
    tok_dir = folder.parent / (folder.name + "-tokenizer")
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok = json.loads((tiny / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = max(max(tok["model"]["vocab"].values()), *(t["id"] for t in tok["added_tokens"])) + 1
    ids = []
    for i, content in enumerate(("<think>", "</think>")):
        tok["added_tokens"].append({"id": next_id + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
        ids.append(next_id + i)
    (tok_dir / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    shutil.copyfile(tiny / "tokenizer_config.json", tok_dir / "tokenizer_config.json")
    make_hf_checkpoint("Qwen3ForCausalLM", folder, tokenizer_dir=tok_dir)
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE, encoding="utf-8")
    return folder, ids[0], ids[1]
