"""Builds the SentencePiece BPE vocabulary a config uses, from its dataset's training captions.

  python -m vlrep.tools.build_vocab --config=configs/virtex.py          # COCO train2017, 10K tokens

Training runs do this on first use; run it ahead of time on one machine for multi-host jobs.
"""

from absl import app, flags
from ml_collections import config_flags

from vlrep.data import pipeline, tokenizers

config_flags.DEFINE_config_file("config", None, "Run config.", lock_config=True)
FLAGS = flags.FLAGS


def main(argv):
  del argv

  config = FLAGS.config
  builder = pipeline.get_builder(config.data.name, config.data.data_dir, config.data.get("config_name"))
  config.tokenizer.unlock()
  config.tokenizer.build_if_missing = True
  tok = tokenizers.ensure_tokenizer(config.tokenizer, builder)
  print(f"{tok.path}: {tok.vocab_size} pieces")


if __name__ == "__main__":
  app.run(main)
