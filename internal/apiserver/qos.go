package apiserver

import (
	"fmt"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/qos"
)

// normalizeQoS checks spec's CPU class and spells it out ("" is latency),
// so records, pools' shapes and the edges see one spelling.
func normalizeQoS(spec *dsecv1.SandboxSpec) error {
	c, err := qos.Parse(spec.GetQos(), qos.Latency)
	if err != nil {
		return fmt.Errorf("spec.qos: %w", err)
	}
	spec.Qos = string(c)
	return nil
}
