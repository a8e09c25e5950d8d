#!/usr/bin/env python3
"""An independent reader (and writer) of BlueField boot streams, for checking nacre-bfb.

Written from the documented layout (Mellanox ATF `bluefield_boot.h`, the header packing of
`mlx-mkbfb`), sharing no code with nacre: each image is three little-endian 64-bit words

    w0 = magic 0x13026642 | major << 32 | minor << 36 | next_ver << 44 | cur_ver << 48
         | (header_len / 8) << 52 | image_id << 56
    w1 = image_len | crc32(data + zero padding to 8 bytes) << 32
    w2 = bitmap of the ids of the images that follow

then the data and its zero padding. As strict as `mlx-mkbfb -d`: major 1, minor <= 2,
header length 24, CRC over data + padding; plus the following-images bitmap.

Usage
  bfb-reader.py dump FILE            one line per image: offset id version length crc following
  bfb-reader.py json FILE            the same as JSON
  bfb-reader.py check FILE           exit 0 if well-formed, else 1 with a one-line reason
  bfb-reader.py extract FILE DIR     write each image as DIR/<name>-v<version> (mlx-mkbfb -x names)
  bfb-reader.py make OUT ID=FILE...  write a stream of those images in mlx-mkbfb's order
                                     (ID a number; FILE '=text' for a literal)
"""
import json
import os
import struct
import sys
import zlib

MAGIC = 0x13026642
# (name, id) in mlx-mkbfb's emission order
ORDER = [("psc-bl", 36), ("psc-fw", 37), ("bl2r-cert", 31), ("bl2r", 30), ("bl2-cert", 6),
         ("bl2", 1), ("sys", 29), ("ddr-cert", 38), ("ddr_ini", 32), ("snps_images", 33),
         ("ddr_ate_imem", 34), ("ddr_ate_dmem", 35), ("bl30-key-cert", 8), ("bl30-cert", 12),
         ("bl30", 2), ("trusted-key-cert", 7), ("bl31-key-cert", 9), ("bl31-cert", 13),
         ("bl31", 3), ("psc-app", 39), ("bl32-key-cert", 10), ("bl32-cert", 14), ("bl32", 4),
         ("bl33-key-cert", 11), ("bl33-cert", 15), ("bl33", 5), ("capsule", 52),
         ("boot-acpi", 55), ("boot-dtb", 56), ("boot-desc", 57), ("boot-path", 58),
         ("boot-args", 59), ("boot-timeout", 60), ("uefi-tests", 61), ("ramdisk", 54),
         ("image", 62), ("initramfs", 63)]
NAMES = {i: n for n, i in ORDER}


class Bad(Exception):
    pass


def pad(n):
    return -n % 8


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise Bad("empty stream")
    images, off = [], 0
    while off < len(data):
        if len(data) - off < 24:
            raise Bad("offset %d: truncated header" % off)
        w0, w1, w2 = struct.unpack_from("<QQQ", data, off)
        if w0 & 0xFFFFFFFF != MAGIC:
            raise Bad("offset %d: bad magic 0x%08x" % (off, w0 & 0xFFFFFFFF))
        major, minor = (w0 >> 32) & 0xF, (w0 >> 36) & 0xF
        if major != 1 or minor > 2:
            raise Bad("offset %d: bad version %d.%d" % (off, major, minor))
        if (w0 >> 52) & 0xF != 3:
            raise Bad("offset %d: bad header length" % off)
        img = {"offset": off, "id": w0 >> 56, "version": (w0 >> 48) & 0xF,
               "next_version": (w0 >> 44) & 0xF, "minor": minor,
               "length": w1 & 0xFFFFFFFF, "crc32": w1 >> 32, "following": w2}
        start = off + 24
        end = start + img["length"] + pad(img["length"])
        if end > len(data):
            raise Bad("offset %d: image %d truncated" % (off, img["id"]))
        crc = zlib.crc32(data[start:end]) & 0xFFFFFFFF
        if crc != img["crc32"]:
            raise Bad("offset %d: image %d crc 0x%08x != 0x%08x" % (off, img["id"], crc, img["crc32"]))
        img["data"] = data[start:start + img["length"]]
        images.append(img)
        off = end
    after = 0
    for img in reversed(images):
        if img["following"] != after:
            raise Bad("offset %d: following-images bitmap 0x%x, but 0x%x follow"
                      % (img["offset"], img["following"], after))
        after |= 1 << img["id"]
    return images


def name(img):
    n = NAMES.get(img["id"], "image_id_%d" % img["id"])
    return n + ("-v%d" % img["version"] if img["minor"] >= 2 else "")


def make(out, specs):
    rank = {i: k for k, (_, i) in enumerate(ORDER)}
    imgs = []
    for s in specs:
        i, src = s.split("=", 1)
        if src.startswith("="):
            data = src[1:].encode()
        else:
            with open(src, "rb") as f:
                data = f.read()
        imgs.append((int(i), data))
    imgs.sort(key=lambda t: rank.get(t[0], len(ORDER) + t[0]))
    ids_after = [0] * len(imgs)
    acc = 0
    for k in range(len(imgs) - 1, -1, -1):
        ids_after[k] = acc
        acc |= 1 << imgs[k][0]
    with open(out, "wb") as f:
        for (i, data), fol in zip(imgs, ids_after):
            body = data + b"\0" * pad(len(data))
            w0 = MAGIC | 1 << 32 | 2 << 36 | 3 << 52 | i << 56
            w1 = len(data) | (zlib.crc32(body) & 0xFFFFFFFF) << 32
            f.write(struct.pack("<QQQ", w0, w1, fol) + body)


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    cmd, path = argv[1], argv[2]
    try:
        if cmd == "make":
            make(path, argv[3:])
            return 0
        images = read(path)
    except (Bad, OSError) as e:
        print("bfb-reader: %s: %s" % (path, e), file=sys.stderr)
        return 1
    if cmd == "dump":
        for i in images:
            print("%d %d %d %d %08x %x %s" % (i["offset"], i["id"], i["version"], i["length"],
                                               i["crc32"], i["following"], name(i)))
    elif cmd == "json":
        print(json.dumps([{k: v for k, v in i.items() if k != "data"} for i in images]))
    elif cmd == "check":
        print("%s: %d images OK" % (path, len(images)))
    elif cmd == "extract":
        os.makedirs(argv[3], exist_ok=True)
        for i in images:
            with open(os.path.join(argv[3], name(i)), "wb") as f:
                f.write(i["data"])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
