"""Torch-side capture: generic module hooks, the HF extractor (train side), the SGLang plugin
(serve side), and importers for files users already have.

Importing this package does not import torch; each submodule that needs torch imports it.
"""
