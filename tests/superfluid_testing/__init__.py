"""Test fixtures that write models: not part of the installed package (DESIGN.md §9).

    tiny.py        TinyModel: a tiny random Llama-family model as GGUF or an HF folder
                   (byte-level BPE tokenizer, chat template), every architecture variant
    tiny_mamba.py  tiny random Mamba, Mamba2 and Jamba GGUFs (llama.cpp's layouts)

Importable from tests as ``superfluid_testing`` (tests/conftest.py puts tests/ on the path).
"""
