"""vlrep's datasets, a TFDS builder module each, named as the dataset: vlrep.data.builders.<name> defines the builder
class of dataset <name> (TFDS names CocoCaptions2017 coco_captions2017). `vlrep.modules` finds one by that name
(`vlrep.data.pipeline.builder_class`); `vlrep.data.pipeline.datasets` lists them. The modules that build no dataset
are the builders' helpers: `_vl_datasets` (the vision-and-language study's shared parts), and `common` (the bounded
reads of a manual_dir) and `scenes` (the synthetic scenes' drawing), which keep the names other modules import them
by (`vlrep.data.pipeline.BUILDER_HELPERS`)."""
