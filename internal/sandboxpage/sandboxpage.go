// Package sandboxpage pages a list of sandboxes: newest first (created
// time, then ID), cut after a cursor that names the last sandbox of the
// page before. The apiserver's List pages with it (ListRequest.page_size
// and page_token), and the web console where it filters past what List
// can ask for. A node answers its own page of an edge's List with Query
// and Pick, which the apiserver merges and cuts again.
//
// A cursor names a position in the order, not an offset, so sandboxes
// made after a page was read come before it and do not shift the pages
// after it; one deleted meanwhile takes nothing with it.
package sandboxpage

import (
	"cmp"
	"encoding/base64"
	"fmt"
	"slices"
	"strconv"
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// MaxSize is the most sandboxes one page holds; a larger page size asks
// for this many.
const MaxSize = 1000

// Sort orders sbs newest first, the ID breaking ties.
func Sort(sbs []*dsecv1.Sandbox) {
	slices.SortFunc(sbs, compare)
}

func compare(a, b *dsecv1.Sandbox) int {
	if c := cmp.Compare(b.GetCreatedUnixMs(), a.GetCreatedUnixMs()); c != 0 {
		return c
	}
	return strings.Compare(a.GetId(), b.GetId())
}

// Token is the cursor of the page after sb.
func Token(sb *dsecv1.Sandbox) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(sb.GetCreatedUnixMs(), 10) + "/" + sb.GetId()))
}

func parse(token string) (*dsecv1.Sandbox, error) {
	raw, err := base64.RawURLEncoding.DecodeString(token)
	ms, id, ok := strings.Cut(string(raw), "/")
	at, perr := strconv.ParseInt(ms, 10, 64)
	if err != nil || !ok || perr != nil || id == "" {
		return nil, fmt.Errorf("page token %q is not one a list gave: %w", token, errdefs.ErrInvalidArgument)
	}
	return &dsecv1.Sandbox{Id: id, CreatedUnixMs: at}, nil
}

// Check checks a page's size and token as Cut does, and returns the
// sandbox the token names (its ID and created time; nil for "", the
// first page), after which the page starts.
func Check(size int, token string) (after *dsecv1.Sandbox, err error) {
	if size <= 0 {
		return nil, fmt.Errorf("page size %d: want at least 1: %w", size, errdefs.ErrInvalidArgument)
	}
	if token == "" {
		return nil, nil
	}
	return parse(token)
}

// Cut returns the page of at most size sandboxes of sorted (in Sort's
// order) that starts after token ("" the first page), and the token of
// the next page ("" when this one is the last).
func Cut(sorted []*dsecv1.Sandbox, size int, token string) ([]*dsecv1.Sandbox, string, error) {
	after, err := Check(size, token)
	if err != nil {
		return nil, "", err
	}
	size = min(size, MaxSize)
	from := 0
	if after != nil {
		// The first sandbox past the cursor: the cursor's own sandbox may
		// be gone.
		from, _ = slices.BinarySearchFunc(sorted, after, compare)
		if from < len(sorted) && compare(sorted[from], after) == 0 {
			from++
		}
	}
	to := min(from+size, len(sorted))
	page := sorted[from:to]
	if to == len(sorted) || len(page) == 0 {
		return page, "", nil
	}
	return page, Token(page[len(page)-1]), nil
}
