#!/usr/bin/env python3
"""Host-side AES-XTS oracle (Python `cryptography`): the dm-crypt `aes-xts-plain64` layout.

    xts-oracle.py encrypt|decrypt KEYFILE IN OUT [--sector-size 4096] [--first-sector N]
                  [--iv-sector-size 512|SECTOR]

KEYFILE holds 64 raw bytes: the AES-256 data key, then the tweak key (IEEE 1619 order, as dm-crypt
takes it). Each sector of IN is one XTS data unit; its tweak is the sector number, little-endian,
zero-padded to 16 bytes (plain64). The sector number counts units of --iv-sector-size: 512 by
default, as dm-crypt does; equal to --sector-size with cryptsetup's --iv-large-sectors.
--first-sector is the number (in --sector-size units) of the first sector of IN on the device.
An independent implementation to check nacred's and the kernel's ciphertext against.
"""
import argparse
import sys

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["encrypt", "decrypt"])
    ap.add_argument("keyfile")
    ap.add_argument("infile")
    ap.add_argument("outfile")
    ap.add_argument("--sector-size", type=int, default=4096)
    ap.add_argument("--iv-sector-size", type=int)
    ap.add_argument("--first-sector", type=int, default=0)
    a = ap.parse_args()
    key = open(a.keyfile, "rb").read()
    if len(key) != 64:
        sys.exit("key must be 64 bytes (AES-256-XTS), got %d" % len(key))
    if key[:32] == key[32:]:
        sys.exit("XTS key halves must differ")
    ivss = a.iv_sector_size or 512
    if a.sector_size % ivss:
        sys.exit("--iv-sector-size must divide --sector-size")
    data = open(a.infile, "rb").read()
    if len(data) % a.sector_size:
        sys.exit("input is not a whole number of %d-byte sectors" % a.sector_size)
    out = bytearray()
    for i in range(len(data) // a.sector_size):
        iv = (a.first_sector + i) * (a.sector_size // ivss)
        c = Cipher(algorithms.AES(key), modes.XTS(iv.to_bytes(16, "little")))
        op = c.encryptor() if a.op == "encrypt" else c.decryptor()
        out += op.update(data[i * a.sector_size:(i + 1) * a.sector_size]) + op.finalize()
    open(a.outfile, "wb").write(out)


if __name__ == "__main__":
    main()
