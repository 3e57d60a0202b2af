"""The tile table's lookup (pure Python: the interpreter itself always gets its small tile)."""

import pytest
import torch

from fmha import configs

ROW = configs.TileConfig(64, 32, 8, 2)


@pytest.mark.parametrize("rows,has_bias,has_dropout,expected", [
    ({}, True, True, None),
    ({"bias": ROW}, True, False, ROW),
    ({"bias": ROW}, True, True, ROW),  # a bias row keeps its reason when dropout comes on top
    ({"bias": ROW}, False, True, None),
    ({"dropout": ROW}, True, True, ROW),
    ({"bias+dropout": ROW, "bias": configs.TileConfig(32, 32, 4, 1)}, True, True, ROW),
    ({"bias+dropout": ROW}, True, False, None),
])
def test_feature_row_lookup_order(rows, has_bias, has_dropout, expected):
    table = {("half", 128, key): row for key, row in rows.items()}
    assert configs.feature_row(table, torch.bfloat16, 128, has_bias, has_dropout) == expected
    assert configs.feature_row(table, torch.float32, 128, has_bias, has_dropout) is None


def test_every_feature_row_names_a_known_feature_and_a_shipped_bucket():
    for table, base in ((configs.FWD_FEATURE_CONFIGS, configs.FWD_CONFIGS),
                        (configs.BWD_FEATURE_CONFIGS, configs.BWD_CONFIGS)):
        for kind, bucket, feature in table:
            assert feature in ("bias", "dropout", "bias+dropout") and (kind, bucket) in base
