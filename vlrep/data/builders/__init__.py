"""vlrep's datasets, a TFDS builder module each, named as the dataset: vlrep.data.builders.<name> defines the builder
class of dataset <name> (TFDS names CocoCaptions2017 coco_captions2017). `vlrep.modules` finds one by that name
(`vlrep.data.pipeline.builder_class`) and lists them (`vlrep.data.pipeline.datasets`); a module here named with a
leading '_' is a helper the builders share (`_vl_datasets`: the vision-and-language study's parts). Their bounded
reads of a manual_dir are vlrep.data.manual_files; the synthetic scenes' drawing is vlrep.data.scenes."""
