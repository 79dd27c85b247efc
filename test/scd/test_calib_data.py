"""Calibration data: the layer selection's items do not depend on how many fit items are drawn."""
import pytest

from sgl_kvxfer.models.loader import load_tokenizer, resolve_tokenizer_path
from sgl_kvxfer.scd.calib.data import SELECT_ITEMS_START, calib_data


def test_selection_items_do_not_move_with_the_fit_size(tiny_pair):
    tok = load_tokenizer(resolve_tokenizer_path(tiny_pair["producer"]))
    specs = ["task:qa", "task:kv"]
    fit_small, sel_small = calib_data(specs, tok, 4, 512, 4, 256, 64, seed=0)
    fit_large, sel_large = calib_data(specs, tok, 12, 512, 4, 256, 64, seed=0)
    assert len(sel_small) == 4 and sel_small == sel_large
    assert fit_large[:4] == fit_small  # more prefixes add items after the same ones
    # a selection pair (prompt without its last token, that token + the answer) is never a fit item
    fits = {tuple(f) for f in fit_large}
    assert not any(tuple(p + c) in fits for p, c in sel_large)


def test_too_many_prefixes_to_keep_the_sets_apart_is_refused(tiny_pair):
    tok = load_tokenizer(resolve_tokenizer_path(tiny_pair["producer"]))
    with pytest.raises(ValueError, match="num-prefixes"):
        calib_data(["task:qa"], tok, SELECT_ITEMS_START + 1, 512, 4, 256, 64, seed=0)
