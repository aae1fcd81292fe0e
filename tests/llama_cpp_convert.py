"""llama.cpp's convert_hf_to_gguf.py for tiny test folders: the BPE pre-tokenizer check
answered ("gpt-2"), and a folder without tokenizer.model is no sentencepiece one (the
converter imports sentencepiece before it looks; Gemma 2's and Phi-3's take the BPE path)."""
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
# Gemma 2's and Phi-3's converters insist on a sentencepiece tokenizer; a folder with none
# takes the BPE path, as Gemma 3's and Phi-4's own converters do (tensors and metadata unchanged).
import conversion.gemma as gemma
import conversion.phi as phi
for cls in (gemma.Gemma2Model, phi.Phi3MiniModel):
    def _vocab(self, own=cls.set_vocab):
        if (self.dir_model / "tokenizer.model").is_file():
            return own(self)
        return self._set_vocab_gpt2()
    cls.set_vocab = _vocab
import runpy
sys.argv[0] = str(root / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
