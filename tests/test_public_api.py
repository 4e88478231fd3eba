"""Every name a public module lists in __all__ imports and is documented."""

import importlib

import pytest

MODULES = [
    "dptrain",
    "dptrain.accounting",
    "dptrain.accounting.accountants",
    "dptrain.accounting.calibration",
    "dptrain.accounting.gdp",
    "dptrain.accounting.hyperparameter_search",
    "dptrain.accounting.ledger",
    "dptrain.accounting.noise",
    "dptrain.cli",
    "dptrain.accounting_demo",
    "dptrain.checkpoint",
    "dptrain.audit",
    "dptrain.audit.exposure",
    "dptrain.audit.one_run",
    "dptrain.audit.lira",
    "dptrain.bench",
    "dptrain.bench.accountants",
    "dptrain.bench.memory",
    "dptrain.bench.report",
    "dptrain.bench.suite",
    "dptrain.bench.timing",
    "dptrain.bench.workloads",
    "dptrain.clipping",
    "dptrain.clipping.engine",
    "dptrain.clipping.functions",
    "dptrain.clipping.graph_check",
    "dptrain.clipping.layout",
    "dptrain.clipping.self_check",
    "dptrain.clipping.oracle",
    "dptrain.clipping.phantom",
    "dptrain.clipping.rules",
    "dptrain.data",
    "dptrain.data.poisson",
    "dptrain.data.sequences",
    "dptrain.data.news",
    "dptrain.data.text_classification",
    "dptrain.data.e2e",
    "dptrain.data.lm_records",
    "dptrain.data.mlm",
    "dptrain.data.tokenizer",
    "dptrain.distributed",
    "dptrain.distributed.context",
    "dptrain.distributed.launcher",
    "dptrain.distributed.optimizer",
    "dptrain.distributed.sampling",
    "dptrain.distributed.setup",
    "dptrain.dpfp",
    "dptrain.config",
    "dptrain.losses",
    "dptrain.mechanisms",
    "dptrain.metrics",
    "dptrain.metrics.ranking",
    "dptrain.models",
    "dptrain.models.gpt",
    "dptrain.models.pretrained",
    "dptrain.models.rnn",
    "dptrain.models.seqrec_transformer",
    "dptrain.models.reattention",
    "dptrain.models.text_classifier",
    "dptrain.optim",
    "dptrain.privacy_engine",
    "dptrain.recipes",
    "dptrain.recipes.seqrec",
    "dptrain.recipes.dpformer_experiment",
    "dptrain.recipes.classify",
    "dptrain.recipes.dpfp_experiment",
    "dptrain.recipes.table2text",
    "dptrain.recipes.table2text_study",
    "dptrain.recipes.mlm",
    "dptrain.recipes.mlm_studies",
    "dptrain.recipes.lm_finetune",
    "dptrain.recipes.exposure",
    "dptrain.recipes.audit_mia",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_all_names_import(module_name):
    module = importlib.import_module(module_name)
    assert module.__all__, f"{module_name} has an empty __all__"
    for name in module.__all__:
        obj = getattr(module, name)
        if callable(obj) and not isinstance(obj, type(importlib)):
            assert obj.__doc__ or name.isupper(), f"{module_name}.{name} has no docstring"
