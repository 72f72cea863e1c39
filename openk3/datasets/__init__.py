"""The data pipelines of the shipped model: the pretraining corpus (:mod:`~openk3.datasets.corpus`,
:mod:`~openk3.datasets.corpus_sources`), the synthetic SFT tasks and mixture
(:mod:`~openk3.datasets.sft_tasks`, :mod:`~openk3.datasets.sft_data`, value pools
:mod:`~openk3.datasets.pools`), induction pretraining documents (:mod:`~openk3.datasets.induction`),
agent-harness prompts (:mod:`~openk3.datasets.harness`) and synthetic image questions
(:mod:`~openk3.datasets.vision_data`). The trainer's loaders are in :mod:`openk3.train.data`."""
