"""llama.cpp's convert_hf_to_gguf.py for tiny test folders: the BPE pre-tokenizer check
answered ("gpt-2"), and a folder without tokenizer.model is no sentencepiece one (the
converter imports sentencepiece before it looks)."""
import sys
from pathlib import Path
root = Path(sys.argv.pop(1))
sys.path[:0] = [str(root), str(root / "gguf-py")]
import conversion.base as base
spm = base.TextModel._create_vocab_sentencepiece
def _spm(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return spm(self)
base.TextModel._create_vocab_sentencepiece = _spm
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import runpy
sys.argv[0] = str(root / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
