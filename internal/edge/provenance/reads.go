package provenance

import (
	"sort"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func sortReads(rs []*dsecv1.ProvenanceRead) {
	sort.Slice(rs, func(i, j int) bool {
		if rs[i].Path != rs[j].Path {
			return rs[i].Path < rs[j].Path
		}
		return rs[i].TimeUnixMs < rs[j].TimeUnixMs
	})
}
