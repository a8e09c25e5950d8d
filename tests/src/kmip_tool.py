"""For tests/kmip.rs: certificates, and PyKMIP's client against the test's
PyKMIP server. Usage:

  kmip_tool.py certs DIR            CA + server (127.0.0.1) + client certificates, and a
                                      second CA with its own server and client certificates
  kmip_tool.py create DIR PORT      create and activate an AES-256 key; prints its id
  kmip_tool.py revoke DIR PORT ID   revoke (key compromise) the key: Compromised
  kmip_tool.py deactivate DIR PORT ID   revoke (cessation of operation): Deactivated
  kmip_tool.py destroy DIR PORT ID  destroy the key
  kmip_tool.py decrypt DIR PORT ID IV_HEX BLOB_HEX   KMIP Decrypt (AES-CBC/PKCS5); hex out
  kmip_tool.py repl DIR PORT        the commands above, one per stdin line (without DIR
                                      PORT), each answered by one line "ok ..." or "err ..."
"""
import datetime
import os
import sys

import ipaddress


def certs(d):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path, cert, key):
        with open(path + ".pem", "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(path + ".key", "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        os.chmod(path + ".key", 0o600)

    def make(prefix):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = (x509.CertificateBuilder().subject_name(name(prefix + " test CA"))
              .issuer_name(name(prefix + " test CA")).public_key(ca_key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(days=1))
              .not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                           content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False,
                                           encipher_only=False, decipher_only=False), critical=True)
              .sign(ca_key, hashes.SHA256()))
        write(os.path.join(d, prefix + "-ca"), ca, ca_key)

        def leaf(cn, eku, san):
            key = ec.generate_private_key(ec.SECP256R1())
            b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                 .public_key(key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(now - datetime.timedelta(days=1))
                 .not_valid_after(now + datetime.timedelta(days=2))
                 .add_extension(x509.ExtendedKeyUsage([eku]), critical=False))
            if san:
                b = b.add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            return b.sign(ca_key, hashes.SHA256()), key

        write(os.path.join(d, prefix + "-server"), *leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, True))
        write(os.path.join(d, prefix + "-client"), *leaf("nacre", ExtendedKeyUsageOID.CLIENT_AUTH, False))

    make("good")
    make("other")


def client(d, port):
    from kmip.pie.client import ProxyKmipClient
    # PyKMIP's client reads /etc/pykmip/pykmip.conf unless given a config file: give it an
    # empty one so only these arguments count.
    conf = os.path.join(d, "client.conf")
    open(conf, "a").close()
    return ProxyKmipClient(hostname="127.0.0.1", port=int(port),
                           cert=os.path.join(d, "good-client.pem"),
                           key=os.path.join(d, "good-client.key"),
                           ca=os.path.join(d, "good-ca.pem"),
                           ssl_version="PROTOCOL_TLSv1_2", config_file=conf)


def one(d, port, argv):
    from kmip.core import enums
    cmd = argv[0]
    with client(d, port) as c:
        if cmd == "create":
            uid = c.create(enums.CryptographicAlgorithm.AES, 256,
                           cryptographic_usage_mask=[enums.CryptographicUsageMask.ENCRYPT,
                                                     enums.CryptographicUsageMask.DECRYPT])
            c.activate(uid)
            print(uid)
        elif cmd == "revoke":
            c.revoke(enums.RevocationReasonCode.KEY_COMPROMISE, argv[1],
                     compromise_occurrence_date=1)
            print("revoked")
        elif cmd == "deactivate":
            # Revoked for a reason other than compromise: the key becomes Deactivated.
            c.revoke(enums.RevocationReasonCode.CESSATION_OF_OPERATION, argv[1])
            print("deactivated")
        elif cmd == "destroy":
            c.destroy(argv[1])
            print("destroyed")
        elif cmd == "decrypt":
            pt = c.decrypt(bytes.fromhex(argv[3]), uid=argv[1],
                           cryptographic_parameters={
                               "block_cipher_mode": enums.BlockCipherMode.CBC,
                               "padding_method": enums.PaddingMethod.PKCS5,
                               "cryptographic_algorithm": enums.CryptographicAlgorithm.AES},
                           iv_counter_nonce=bytes.fromhex(argv[2]))
            print(pt.hex())
        else:
            raise SystemExit("unknown command " + cmd)


def main():
    if sys.argv[1] == "certs":
        certs(sys.argv[2])
        return
    d, port = sys.argv[2], sys.argv[3]
    if sys.argv[1] != "repl":
        one(d, port, sys.argv[1:2] + sys.argv[4:])
        return
    # One command per line on stdin, one answer line ("ok ..." or "err ...") on stdout:
    # the test pays Python's start-up once.
    for line in sys.stdin:
        import io
        import contextlib
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                one(d, port, line.split())
            print("ok " + out.getvalue().strip(), flush=True)
        except BaseException as e:  # noqa: B902 - every failure is an answer
            print("err " + " ".join(str(e).split()), flush=True)


main()
