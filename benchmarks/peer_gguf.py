"""A random Dream folder at the peer's shape and its float32 GGUF, for `dllm bench --peer`.

Run with the Python that has llama.cpp's converter requirements (the source tree's gguf-py,
numpy, sentencepiece, safetensors, transformers 4.57.x, torch; docs/cpu.md):

    /work/peer/venv/bin/python benchmarks/peer_gguf.py --llama-cpp /work/peer/llama.cpp \
        --folder /work/peer/dream-512 --out /work/peer/dream-512-f32.gguf [--width 512]

The folder is written only when missing (tests/checkpoints.py's Dream writer: hidden 512,
8 layers, 8 heads, 4 KV heads, intermediate 1408, float32, seed 0). Two things the converter
needs that a real Dream folder has and the test writer leaves out are added here: the
`tokenization_dream.py` its tokenizer_config.json names (the converter loads the tokenizer
with remote code), and the pre-tokenizer's name (`qwen2`, Dream's own): the converter
recognises a BPE pre-tokenizer by hashing its tokens of a fixed text, and a small test
vocabulary matches no known hash.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Dream's tokenizer is Qwen2's under another name (Dream-v0's tokenization_dream.py).
DREAM_TOKENIZER = '''"""Dream's tokenizer: Qwen2's byte-level BPE under Dream's class name."""

from transformers import Qwen2Tokenizer


class DreamTokenizer(Qwen2Tokenizer):
    """The class tokenizer_config.json names."""
'''


def write_folder(folder: Path, width: int) -> None:
    """The peer's random Dream folder (benchmarks/cpu_bench.py's shape) plus its tokenizer code."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from checkpoints import write_dream

    shape = {"hidden_size": width, "num_hidden_layers": 8, "num_attention_heads": width // 64}
    shape |= {"num_key_value_heads": width // 128, "intermediate_size": width * 11 // 4}
    write_dream(folder, dtype=torch.float32, seed=0, **shape)
    (folder / "tokenization_dream.py").write_text(DREAM_TOKENIZER)


def convert(llama_cpp: Path, folder: Path, out: Path) -> None:
    """convert_hf_to_gguf.py --outtype f32, with the pre-tokenizer named qwen2."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f32", "--outfile", str(out)]
    convert_hf_to_gguf.main()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    p.add_argument("--folder", type=Path, required=True, help="Dream folder (written if missing)")
    p.add_argument("--out", type=Path, required=True, help="GGUF to write")
    p.add_argument("--width", type=int, default=512, help="hidden size of a new folder")
    args = p.parse_args()
    if not (args.folder / "config.json").is_file():
        write_folder(args.folder, args.width)
    elif not (args.folder / "tokenization_dream.py").is_file():
        (args.folder / "tokenization_dream.py").write_text(DREAM_TOKENIZER)
    convert(args.llama_cpp, args.folder, args.out)


if __name__ == "__main__":
    main()
