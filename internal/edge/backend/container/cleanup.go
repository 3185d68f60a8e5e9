package container

import "errors"

// cleanup undoes the steps of a half-made sandbox in reverse order, unless
// release is called once the whole sandbox stands.
type cleanup struct {
	fns []func() error
}

func (c *cleanup) add(fn func() error) { c.fns = append(c.fns, fn) }

func (c *cleanup) release() { c.fns = nil }

func (c *cleanup) run() error {
	var errs []error
	for i := len(c.fns) - 1; i >= 0; i-- {
		if err := c.fns[i](); err != nil {
			errs = append(errs, err)
		}
	}
	c.fns = nil
	return errors.Join(errs...)
}
