// Package clustertls owns the cluster's PKI: the certificate authority that
// `dsecd init-cluster` creates, the leaf certificates it issues to apiservers
// and edges, and the mutual-TLS configurations those components serve and dial
// with.
//
// A leaf carries its component's role and name in a URI SAN, dsec://ROLE/NAME
// (dsec://edge/node-3), and peers are identified from that SAN, never from the
// subject's common name. Every leaf has both the server and the client extended
// key usage, so one certificate serves an edge's listener and an apiserver's
// outgoing connections alike; which peer is let in is decided by role: an
// edge's ServerConfig accepts only apiserver certificates, so an edge cannot
// dial another edge even though both hold certificates from the same CA.
//
// ServerConfig and ClientConfig re-read their certificate, key and CA bundle
// when the files change on disk (checked at most once per second, at a
// handshake), so rotating a leaf or the CA needs no restart: a bundle may hold
// several CA certificates while a new CA is rolled out. Nothing here logs; a
// refused handshake returns an error that names the peer and the reason.
//
// The files init-cluster lays out, and the rotation procedures, are described
// in docs/cluster.md ("Certificates").
package clustertls
