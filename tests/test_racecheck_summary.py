"""tools/racecheck_summary.py: racecheck's reports grouped into classes, known ones named, a new one flagged."""
import pytest

from helpers import load_tool

# Lines as compute-sanitizer 2025.3 writes them (arguments shortened), two reports of known classes and one new
LOG = """\
========= COMPUTE-SANITIZER
.....========= Error: Race reported between Read access at void store_staged_rows<float, write_output(const \
MLAParams &, const Smem &, int)::[lambda(int) (instance 2)]>(const Smem &, T2 &&, T3 &&, int)+0xc650 in kernel.cu:633
=========     and Write access at attnforge::cp_async_16_at(unsigned int, const void *, bool)+0x2b00 in \
cp_async.cuh:23 [252 hazards]
=========     and Write access at write_output(const MLAParams &, const Smem &, int)::[lambda(int, int, float) \
(instance 1)]::operator ()(int, int, float) const+0xb0f0 in kernel.cu:677 [16 hazards]
=========     and Write access at write_output(const MLAParams &, const Smem &, int)::[lambda(int, int, float) \
(instance 1)]::operator ()(int, int, float) const+0xb100 in kernel.cu:677 [16 hazards]
=========
========= Error: Race reported between Read access at roles_pv_tile(const MLAParams &, const Smem &, int)+0x4c60 \
in kernel.cu:670
=========     and Write access at roles_scores_tile(const MLAParams &, int)::[lambda(const unsigned int (&)[16]) \
(instance 1)]::operator ()(const unsigned int (&)[16]) const+0x9510 in kernel.cu:586 [1664 hazards]
=========
========= Error: Race reported between Write access at publish(const WarpState &, float *)+0x100 in kernel.cu:9
=========     and Read access at void finish_item<float>(const DecodeParams &, float *)+0x200 in \
kernel.cu:12 [4 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""


def test_function_names_lose_templates_arguments_and_offsets():
    tool = load_tool("racecheck_summary")
    assert tool.function_name("void store_staged_rows<float, x<y>>(const Smem &)+0x10 in kernel.cu:1") == \
        "store_staged_rows"
    assert tool.function_name("attnforge::cp_async_16_at(unsigned int)+0x2b00 in cp_async.cuh:23") == "cp_async_16_at"
    assert tool.function_name("write_output(const P &)::[lambda(int) (instance 1)]::operator ()(int) const+0x1") == \
        "write_output"


def test_reports_group_into_classes_once_a_report():
    found = load_tool("racecheck_summary").classes(LOG)
    assert found == {("Read", "store_staged_rows", "Write", "cp_async_16_at"): 1,
                     ("Read", "store_staged_rows", "Write", "write_output"): 1,  # (two lines of one report)
                     ("Read", "roles_pv_tile", "Write", "roles_scores_tile"): 1,
                     ("Write", "publish", "Read", "finish_item"): 1}


def test_a_new_class_fails_and_known_ones_pass(tmp_path, capsys):
    tool = load_tool("racecheck_summary")
    log = tmp_path / "race.log"
    log.write_text(LOG)
    assert tool.main([str(log)]) == 1
    out = capsys.readouterr().out
    assert "Write publish / Read finish_item: NEW" in out and "roles kernel" in out
    known_only = tmp_path / "known.log"
    known_only.write_text(LOG.split("========= Error: Race reported between Write access at publish")[0])
    assert tool.main([str(known_only)]) == 0


def test_a_missing_log_is_named(tmp_path):
    with pytest.raises(SystemExit, match="expected racecheck logs, got .*nowhere.log"):
        load_tool("racecheck_summary").main([str(tmp_path / "nowhere.log")])
