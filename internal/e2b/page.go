package e2b

import (
	"encoding/base64"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// pageItem is one listed thing as paging sees it: when it started (Unix
// ms) and its ID, which breaks ties.
type pageItem struct {
	At int64
	ID string
}

// paginate sorts items as E2B's API does (newest first, ties by ID
// ascending; ascending is the exact reverse) and returns the page that
// follows token ("" = the first), at most limit long, and the token of the
// next page ("" = this is the last). A token is a cursor: the last item of
// its page, so sandboxes that come or go between pages shift nothing.
func paginate(items []pageItem, limit int, token string, ascending bool) ([]pageItem, string, error) {
	items = slices.Clone(items)
	slices.SortFunc(items, func(a, b pageItem) int {
		c := compareItems(a, b)
		if ascending {
			return -c
		}
		return c
	})
	if token != "" {
		cur, err := parseCursor(token)
		if err != nil {
			return nil, "", err
		}
		i := 0
		for i < len(items) {
			c := compareItems(items[i], cur)
			if ascending {
				c = -c
			}
			if c > 0 {
				break
			}
			i++
		}
		items = items[i:]
	}
	if len(items) <= limit {
		return items, "", nil
	}
	return items[:limit], cursorOf(items[limit-1]), nil
}

// compareItems orders newest first, then by ID.
func compareItems(a, b pageItem) int {
	if a.At != b.At {
		if a.At > b.At {
			return -1
		}
		return 1
	}
	return strings.Compare(a.ID, b.ID)
}

func cursorOf(it pageItem) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(it.At, 10) + "__" + it.ID))
}

func parseCursor(token string) (pageItem, error) {
	bad := fmt.Errorf("nextToken %q is not a token this server gave: %w", token, errdefs.ErrInvalidArgument)
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil {
		return pageItem{}, bad
	}
	at, id, ok := strings.Cut(string(b), "__")
	if !ok {
		return pageItem{}, bad
	}
	n, err := strconv.ParseInt(at, 10, 64)
	if err != nil {
		return pageItem{}, bad
	}
	return pageItem{At: n, ID: id}, nil
}

func urlUnescape(s string) (string, error) { return url.QueryUnescape(s) }

// writePage answers the page of items that follows token, each item as
// body makes it of its ID, and names the next page in X-Next-Token.
func writePage[T any](w http.ResponseWriter, items []pageItem, limit int, token string, ascending bool, body func(id string) T) error {
	page, next, err := paginate(items, limit, token, ascending)
	if err != nil {
		return err
	}
	out := make([]T, 0, len(page))
	for _, it := range page {
		out = append(out, body(it.ID))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}
