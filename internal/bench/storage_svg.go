package bench

import (
	"fmt"
	"html"
	"io"
	"strings"
)

// svgPanel is one bar chart of the figure: one bar per mode.
type svgPanel struct {
	title  string
	unit   string
	values []float64 // per mode; < 0 = not measured
}

var modeColors = map[string]string{
	ModeLocal:    "#4c72b0",
	ModeOnDemand: "#55a868",
	ModeTraced:   "#8fd19e",
	ModeEager:    "#c44e52",
	ModeTar:      "#8172b2",
}

// SVG writes the report's bar charts (burst wall time, bytes fetched, bytes
// written to local disk, fraction of image bytes read) as one SVG image.
func (r *StorageReport) SVG(w io.Writer) error {
	var modes []ModeResult
	for _, m := range r.Modes {
		if m.Skipped == "" {
			modes = append(modes, m)
		}
	}
	panels := []svgPanel{
		{title: "burst wall time", unit: "s"},
		{title: "fetched from blob store", unit: "GB"},
		{title: "written to local disk", unit: "GB"},
		{title: "image bytes read", unit: "%"},
	}
	for _, m := range modes {
		panels[0].values = append(panels[0].values, m.BurstWallS)
		panels[1].values = append(panels[1].values, float64(m.BytesFetched)/1e9)
		panels[2].values = append(panels[2].values, float64(m.DiskWritten)/1e9)
		fr := -1.0
		if m.FractionRead >= 0 {
			fr = 100 * m.FractionRead
		}
		panels[3].values = append(panels[3].values, fr)
	}

	const (
		pw       = 300 // panel width
		top      = 90
		left     = 20
		plotH    = 170
		barGap   = 12
		fontAttr = `font-family="sans-serif"`
	)
	width := left*2 + pw*len(panels)
	targetsY := top + 30 + plotH + 44
	height := targetsY + 18*len(r.Targets) + 10
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	title := fmt.Sprintf("dsec bench storage: %d sandboxes over %d images, %d at a time", r.Sandboxes, len(r.Images), r.Concurrency)
	fmt.Fprintf(&b, `<text x="%d" y="26" %s font-size="16" font-weight="bold">%s</text>`+"\n", left, fontAttr, html.EscapeString(title))
	fmt.Fprintf(&b, `<text x="%d" y="46" %s font-size="12">blob store: %s</text>`+"\n", left, fontAttr, html.EscapeString(r.RemoteModel))
	// Legend.
	x := left
	for _, m := range modes {
		fmt.Fprintf(&b, `<rect x="%d" y="60" width="12" height="12" fill="%s"/>`, x, modeColors[m.Mode])
		fmt.Fprintf(&b, `<text x="%d" y="71" %s font-size="12">%s</text>`+"\n", x+16, fontAttr, html.EscapeString(modeLabel(m.Mode)))
		x += 110
	}
	// Targets, below the panels.
	for i, t := range r.Targets {
		res, color := "n/a", "#666"
		if t.Ratio >= 0 {
			res, color = "MISS", "#c44e52"
			if t.Pass {
				res, color = "PASS", "#2e7d32"
			}
		}
		line := fmt.Sprintf("%s: %s (goal %s) %s", t.Name, ratioText(t.Ratio), t.Goal, t.Detail)
		y := targetsY + 18*i
		fmt.Fprintf(&b, `<text x="%d" y="%d" %s font-size="12" font-weight="bold" fill="%s">%s</text>`, left, y, fontAttr, color, res)
		fmt.Fprintf(&b, `<text x="%d" y="%d" %s font-size="12">%s</text>`+"\n", left+44, y, fontAttr, html.EscapeString(line))
	}
	for i, p := range panels {
		px := left + i*pw
		base := top + 30 + plotH
		fmt.Fprintf(&b, `<text x="%d" y="%d" %s font-size="13" text-anchor="middle">%s (%s)</text>`+"\n",
			px+pw/2, top+12, fontAttr, html.EscapeString(p.title), html.EscapeString(p.unit))
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#333"/>`+"\n", px+10, base, px+pw-10, base)
		maxV := 0.0
		for _, v := range p.values {
			if v > maxV {
				maxV = v
			}
		}
		n := len(p.values)
		if n == 0 {
			continue
		}
		bw := (pw - 20 - barGap*(n+1)) / n
		for j, v := range p.values {
			bx := px + 10 + barGap + j*(bw+barGap)
			label := "n/a"
			h := 0
			if v >= 0 {
				label = formatValue(v)
				if maxV > 0 {
					h = int(float64(plotH) * v / maxV)
				}
			}
			fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="%s"/>`+"\n", bx, base-h, bw, h, modeColors[modes[j].Mode])
			fmt.Fprintf(&b, `<text x="%d" y="%d" %s font-size="11" text-anchor="middle">%s</text>`+"\n", bx+bw/2, base-h-4, fontAttr, label)
			fmt.Fprintf(&b, `<text x="%d" y="%d" %s font-size="10" text-anchor="middle">%s</text>`+"\n", bx+bw/2, base+14, fontAttr, html.EscapeString(modeLabel(modes[j].Mode)))
		}
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func ratioText(r float64) string {
	if r < 0 {
		return "-"
	}
	return fmt.Sprintf("%.3f", r)
}

func formatValue(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}
