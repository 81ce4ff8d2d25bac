"""tools/sass_same.py compares instruction streams with addresses and encodings dropped: two listings of the
same code at other addresses compare equal, and a reordered or changed instruction does not."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from sass_same import instructions  # noqa: E402

LISTING = """
        .text.batch_decode_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
                                                                                 /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */
.L_x_1:
        /*0020*/              @!P0 BRA `(.L_x_1) ;
"""


def test_addresses_and_encodings_drop_out_and_instructions_stay_in_order():
    moved = LISTING.replace("/*0000*/", "/*0100*/").replace("/*0010*/", "/*0110*/").replace("/*0020*/", "/*0120*/")
    assert instructions(LISTING) == instructions(moved) == [
        "LDC R1, c[0x0][0x28] ;", "S2R R0, SR_TID.X ;", "@!P0 BRA `(.L_x_1) ;"]
    swapped = LISTING.replace("LDC R1", "LDC R2")
    assert instructions(swapped) != instructions(LISTING)
