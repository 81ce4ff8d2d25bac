"""tools/stall_summary.py: the top stalled instructions of an ncu source page, with their reasons."""
import csv

from helpers import load_tool


def test_ranks_instructions_by_samples_with_their_stall_reasons(tmp_path, capsys):
    page = tmp_path / "source.csv"
    with page.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ncu preamble line"])  # what precedes the table in ncu's output
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_barrier", "stall_long_sb",
                    "stall_long_sb (Not Issued)"])
        w.writerow(["0x10", "NOP", "3", "0", "0", "0"])
        w.writerow(["0x20", "ISETP.GE.AND P0, PT, R104, R85, PT", "1,981", "0", "1952", "480"])
        w.writerow(["0x30", "@P0 BRA 0x7f", "861", "837", "0", "0"])
    load_tool("stall_summary").main(str(page), 2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "3 instructions, 2845 samples"
    assert "ISETP.GE.AND" in lines[1] and "69.6%" in lines[1] and "long_sb 1952" in lines[1]
    assert "Not Issued" not in lines[1] and "BRA" in lines[2] and "barrier 837" in lines[2] and len(lines) == 3
